"""A Tinker training client's sampler checkpoint in Chromium, on the real stack (see conftest): the
run of kind tinker lists the checkpoint under its step, and the checkpoint page's playground
streams answers from it (through the gateway and the inference server) beside its base model."""

from __future__ import annotations

import pytest

from projects import services
from projects.storage import checkpoint_upload
from tests.browser.conftest import chat_in_playground
from tests.browser.test_dashboard import workspace  # noqa: F401  (the fixture)
from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.runs.steps import checkpoint_path
from training.session.policy import Policy

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_tinker_sampler_checkpoint_answers_in_the_playground(
    stack,
    workspace,  # noqa: F811
    browser,
    settings,
    tiny_model_dir,
    tmp_path,
):
    page, url = browser.page, stack.web.url
    settings.CHECKPOINT_DIR = tmp_path / "data" / "checkpoints"  # the stack's store
    session = services.tinker_session_create(team=workspace.team, project=workspace.name, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    tinker = services.tinker_model_create(session=session, model_seq_id=0, base_model="tiny",
                                          lora_config={"rank": 4})  # fmt: skip
    # What the worker's save_weights_for_sampler writes after one optim_step: the session's state.
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path / "cache")
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec.from_dict(tinker.model.lora))
    folder = checkpoint_path(settings.CHECKPOINT_DIR / f"model-{tinker.model.pk}", 1)
    trainer.save_checkpoint(folder, step=1, metrics={})
    services.tinker_loss_add(model=tinker, loss=2.0)
    services.tinker_step_record(model=tinker, step=1, metrics={"grad_norm": 0.5, "learning_rate": 1e-3},
                                seconds=1.0)  # fmt: skip
    stored = checkpoint_upload(model_id=tinker.model.pk, step=1, folder=folder)
    services.tinker_checkpoint_record(model=tinker, step=1, path=str(folder), stored=stored,
                                      name="sampler_weights/final")  # fmt: skip

    page.goto(f"{url}/projects/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/projects/")
    page.goto(f"{url}/runs/{tinker.run.pk}/")
    assert "tinker run" in page.content()
    page.get_by_role("link", name="step 1", exact=True).click()
    page.wait_for_selector("#playground")
    served_as = f"{workspace.name}/{tinker.model.name}:1"
    assert served_as in page.locator("#snippet-python").inner_text()
    assert chat_in_playground(page, "Say a", max_tokens=8)["checkpoint"].strip()
    browser.screenshot("tinker-checkpoint-playground")
    assert not browser.console_errors, browser.console_errors
