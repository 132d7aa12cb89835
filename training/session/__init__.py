"""Training sessions: the contract (training.session.contract: the primitives, their types and
input checks) and the session in this process (training.session.local). The trainer service's
(training.hosting.client.RemoteSession) and data-parallel ranks' (training.hosting.ranks) sessions
keep the same contract."""

from typing import TYPE_CHECKING

from training.session.contract import (
    BASE_MODEL,
    WHOLE_CALL_LOSSES,
    Datum,
    ForwardBackwardResult,
    Session,
    check_prompt_ids,
    check_token_ids,
    datum_of,
)
from training.session.local import SampleInProgress, TrainingSession, context_length_of

__all__ = [
    "BASE_MODEL",
    "WHOLE_CALL_LOSSES",
    "Datum",
    "ForwardBackwardResult",
    "SampleInProgress",
    "Session",
    "TrainingSession",
    "check_prompt_ids",
    "check_token_ids",
    "context_length_of",
    "datum_of",
]

if TYPE_CHECKING:  # every implementation keeps the contract: mypy checks these against Session
    from training.hosting.client import RemoteSession
    from training.hosting.followers import MirroredSession
    from training.hosting.ranks import DataParallelSession

    def _implementations(
        local: TrainingSession, remote: RemoteSession, ranks: DataParallelSession, mirrored: MirroredSession
    ) -> list[Session]:
        return [local, remote, ranks, mirrored]
