"""A Tinker training client's cost line counts its tokens: each optim_step's step records the
positions its forward_backward calls trained on and the tokens sampled from the client's own
checkpoints since the step before (not another team's samples, not twice)."""

from __future__ import annotations

import pytest
from django.test import Client

from projects import selectors, services
from projects.jobs.tinker import trained_tokens
from projects.models import Checkpoint, TinkerFuture
from training.session.contract import Datum

pytestmark = pytest.mark.django_db


def test_trained_tokens_are_the_weighted_or_advantaged_positions():
    ids = [1, 2, 3, 4]
    targets = [2.0, 3.0, 4.0, 5.0]
    weighted = Datum([*ids], {"target_tokens": targets, "weights": [0.0, 0.0, 1.0, 1.0]})
    advantaged = Datum([*ids], {"target_tokens": targets, "advantages": [0.0, 0.5, -0.5, 0.0]})
    plain = Datum([*ids], {"target_tokens": targets})
    assert trained_tokens([weighted, advantaged, plain]) == 2 + 2 + 4


def _done(future: TinkerFuture, result: dict) -> None:
    services.tinker_future_finish(future=future, result=result, seconds=0.5)


def test_a_tinker_runs_cost_line_counts_the_tokens_it_trained_and_sampled(cast):
    base = services.base_model_register(name="tiny", source="/nowhere")
    session = services.tinker_session_create(team=cast.alpha, project=None, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    tinker = services.tinker_model_create(session=session, model_seq_id=0, base_model="tiny", lora_config={})
    step0 = Checkpoint.objects.get(model=tinker.model, step=0)
    sampler = services.tinker_sampler_create(
        session=session, sampler_id=None, base_model=base, checkpoint=step0
    )
    for team, tokens in ((cast.alpha, 7), (cast.beta, 100)):  # beta sampling alpha's model is not alpha's
        sample = services.tinker_future_submit(team=team, kind="sample", payload={"sampler": sampler.pk})
        _done(sample, {"completion_tokens": tokens})
    for seq, tokens in ((1, 3), (2, 2)):
        fb = services.tinker_future_submit(team=cast.alpha, kind="forward_backward", model=tinker, seq_id=seq)
        _done(fb, {"trainable_tokens": tokens})
    step = services.tinker_future_submit(team=cast.alpha, kind="optim_step", model=tinker, seq_id=3)
    services.tinker_step_record(model=tinker, step=1, metrics={}, seconds=1.0)
    _done(step, {})
    step = services.tinker_future_submit(team=cast.alpha, kind="optim_step", model=tinker, seq_id=4)
    services.tinker_step_record(model=tinker, step=2, metrics={}, seconds=1.0)  # nothing new: no tokens
    cost = selectors.run_cost(run=tinker.run)
    assert (cost["sampled_tokens"], cost["trained_tokens"]) == (7, 5), cost
    page = Client()
    page.force_login(cast.alice)
    detail = page.get(f"/runs/{tinker.run.pk}/").content.decode()
    line = " ".join(detail[detail.index('class="cost-line"') :].split("</p>")[0].split())
    assert "12 tokens (7 sampled, 5 trained)" in line
