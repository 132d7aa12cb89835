"""Training sessions: the contract (training.session.contract: the primitives, their types and
input checks) and the session in this process (training.session.local). The trainer service's
(training.hosting.client.RemoteSession) and data-parallel ranks' (training.hosting.ranks) sessions
keep the same contract.

Import from the modules themselves: this package's own import loads nothing, so a module that
needs only the checkpoint's file names (training.session.checkpoint_files) or the contract's types
does not load torch, transformers and peft with it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every implementation keeps the contract: mypy checks these against Session
    from training.hosting.client import RemoteSession
    from training.hosting.followers import MirroredSession
    from training.hosting.ranks import DataParallelSession
    from training.session.contract import Session
    from training.session.local import TrainingSession

    def _implementations(
        local: TrainingSession, remote: RemoteSession, ranks: DataParallelSession, mirrored: MirroredSession
    ) -> list[Session]:
        return [local, remote, ranks, mirrored]
