"""Exports of a checkpoint on the tiny model: the adapter archive loads with peft and the merged
export (a Celery job run in-process: claim, merge, store) loads with transformers alone; both
give the logits of the engine serving the checkpoint (fp32, max abs difference printed)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from projects import services, storage
from projects.jobs import claimed
from projects.jobs.exports import EXPORT
from projects.models import Checkpoint, Export
from projects.services.exports import _enqueue as real_enqueue
from tests import factories
from tests.conftest import error_of
from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.engines.transformers_engine import TransformersEngine
from training.session.policy import Policy

# Committed rows: the job's heartbeat thread reads them on its own connection.
pytestmark = pytest.mark.django_db(transaction=True)

FP32_TOLERANCE = 1e-4
PROMPT = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture
def enqueued(monkeypatch) -> list[int]:
    sent: list[int] = []
    monkeypatch.setattr("projects.services.exports._enqueue", sent.append)
    return sent


@pytest.fixture
def trained(cast, tiny_model_dir: Path, settings, tmp_path: Path, enqueued):
    """Step 1 of alpha's model: a real adapter (LoRA B set away from zero, so merging matters)."""
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    settings.MODEL_CACHE_DIR = tmp_path / "models"
    settings.RUN_HEARTBEAT_TIMEOUT_S = 30
    base = services.base_model_register(name="tiny", source=str(tiny_model_dir))
    project = factories.ProjectFactory(team=cast.alpha, name="math")
    model = factories.TrainableModelFactory(project=project, name="agent", base_model=base, lora={"rank": 4})
    services.checkpoint_record(model=model, run=None, step=0, path="")
    policy, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    trainer = Policy(policy, tokenizer, TrainConfig(), LoraSpec.from_dict(model.lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    folder = settings.CHECKPOINT_DIR / f"model-{model.pk}" / "step-000001"
    trainer.save_checkpoint(folder, step=1, metrics={"reward_mean": 0.5})
    checkpoint = services.checkpoint_record(
        model=model, run=None, step=1, path=str(folder), metrics={"reward_mean": 0.5}
    )
    return type(
        "Trained",
        (),
        {"model": model, "checkpoint": checkpoint, "folder": folder, "base_dir": tiny_model_dir},
    )


def prompt_ids(base_dir: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text)["input_ids"]])


def served_logits(trained) -> torch.Tensor:
    """The logits of the engine serving the checkpoint (base model + the adapter loaded)."""
    base, tokenizer = load_base_model(str(trained.base_dir), trained.base_dir.parent)
    engine = TransformersEngine(base, tokenizer)
    engine.load_adapter("step-1", trained.folder)
    with torch.no_grad():
        return engine.model(prompt_ids(trained.base_dir)).logits


def unpack(response, into: Path) -> list[str]:
    assert response.status_code == 200, response
    assert response["Content-Type"] == "application/gzip"
    data = b"".join(response.streaming_content)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(into, filter="data")
        return sorted(archive.getnames())


def test_the_adapter_archive_loads_with_peft_and_gives_the_served_logits(
    trained, alice_client, bob_client, tmp_path
):
    url = f"/api/v1/checkpoints/{trained.checkpoint.pk}/adapter"
    names = unpack(bob_client.get(url), tmp_path / "adapter")  # a viewer may download
    assert names == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "step 1" in card and "`tiny`" in card and "reward_mean: 0.5" in card
    base, _ = load_base_model(str(trained.base_dir), tmp_path)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        logits = loaded(prompt_ids(trained.base_dir)).logits
    reference = served_logits(trained)
    difference = (logits - reference).abs().max().item()
    print(f"adapter archive vs served checkpoint: max abs logit difference {difference:.3g}")
    assert difference <= FP32_TOLERANCE
    plain, _ = load_base_model(str(trained.base_dir), tmp_path)
    with torch.no_grad():  # the adapter changes the model: the comparison is not vacuous
        assert (
            plain(prompt_ids(trained.base_dir)).logits - reference
        ).abs().max().item() > 100 * FP32_TOLERANCE


def test_a_merged_export_is_a_job_whose_folder_loads_with_transformers_alone(
    trained, alice_client, enqueued, tmp_path
):
    url = f"/api/v1/checkpoints/{trained.checkpoint.pk}/exports"
    response = alice_client.post(url, {"format": "merged"}, format="json")
    assert response.status_code == 201, response.json()
    export = response.json()
    assert export["status"] == "queued" and export["model_id"] == "math/agent:1"
    assert enqueued == [export["id"]]  # after commit
    assert alice_client.post(url, {}, format="json").json()["id"] == export["id"]  # not twice
    early = alice_client.get(f"/api/v1/exports/{export['id']}/content")
    assert early.status_code == 409 and error_of(early)["code"] == "not_ready"

    assert claimed.work_on(EXPORT, export["id"]) == "succeeded"
    assert claimed.work_on(EXPORT, export["id"]) == "skipped"  # a duplicate delivery
    done = alice_client.get(f"/api/v1/exports/{export['id']}").json()
    assert done["status"] == "succeeded" and done["size_bytes"] > 0 and done["seconds"] > 0
    names = unpack(alice_client.get(f"/api/v1/exports/{export['id']}/content"), tmp_path / "merged")
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(names)
    assert not any(name.startswith("adapter") for name in names)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        logits = merged(prompt_ids(trained.base_dir)).logits
    difference = (logits - served_logits(trained)).abs().max().item()
    print(f"merged export vs served checkpoint: max abs logit difference {difference:.3g}")
    assert difference <= FP32_TOLERANCE
    listed = alice_client.get(url).json()
    assert [e["id"] for e in listed["data"]] == [export["id"]]


def test_deleting_the_checkpoint_removes_its_exports_files(
    trained, alice_client, tmp_path, django_capture_on_commit_callbacks
):
    export, _ = services.export_create(checkpoint=trained.checkpoint)
    assert claimed.work_on(EXPORT, export.pk) == "succeeded"
    export.refresh_from_db()
    store = storage.checkpoint_store()
    assert export.key in store.list_keys(f"model-{trained.model.pk}/")
    later = trained.folder.parent / "step-000002"
    later.mkdir()
    (later / "adapter_model.safetensors").write_bytes(b"x")
    services.checkpoint_record(model=trained.model, run=None, step=2, path=str(later))
    assert alice_client.delete(f"/api/v1/checkpoints/{trained.checkpoint.pk}").status_code == 204
    assert store.list_keys(f"model-{trained.model.pk}/") == [f"model-{trained.model.pk}/step-000002"]
    assert not Export.objects.filter(pk=export.pk).exists()


def test_a_checkpoint_being_exported_is_in_use(trained, alice_client):
    later = trained.folder.parent / "step-000002"
    later.mkdir()
    services.checkpoint_record(model=trained.model, run=None, step=2, path=str(later))
    export, _ = services.export_create(checkpoint=trained.checkpoint)
    response = alice_client.delete(f"/api/v1/checkpoints/{trained.checkpoint.pk}")
    assert response.status_code == 409 and f"export {export.pk} (queued)" in error_of(response)["message"]


def test_export_endpoints_outsider_404_viewer_403_bad_input_400(
    trained, alice_client, bob_client, charlie_client, read_only_client
):
    checkpoint = trained.checkpoint
    url = f"/api/v1/checkpoints/{checkpoint.pk}/exports"
    for viewer in (bob_client, read_only_client):
        assert viewer.post(url, {"format": "merged"}, format="json").status_code == 403
    bad = alice_client.post(url, {"format": "gguf"}, format="json")
    assert bad.status_code == 400 and error_of(bad)["param"] == "format"
    untrained = Checkpoint.objects.get(model=trained.model, step=0)
    refused = alice_client.post(f"/api/v1/checkpoints/{untrained.pk}/exports", {}, format="json")
    assert refused.status_code == 409 and error_of(refused)["code"] == "nothing_to_export"
    assert alice_client.get(f"/api/v1/checkpoints/{untrained.pk}/adapter").status_code == 409
    export = alice_client.post(url, {}, format="json").json()
    assert bob_client.get(f"/api/v1/exports/{export['id']}").status_code == 200
    for path in (url, f"/api/v1/exports/{export['id']}", f"/api/v1/exports/{export['id']}/content"):
        assert charlie_client.get(path).status_code == 404
    assert charlie_client.post(url, {}, format="json").status_code == 404
    assert Export.objects.count() == 1


def test_orphaned_exports_are_sent_again_to_their_base_models_queue(trained, monkeypatch, settings):
    from datetime import timedelta

    from django.utils import timezone

    from projects.jobs import tasks
    from projects.models import BaseModel

    sent: list[tuple[tuple, str]] = []
    monkeypatch.setattr(
        tasks.export_checkpoint, "apply_async", lambda args, queue: sent.append((tuple(args), queue))
    )
    monkeypatch.setattr("projects.services.exports._enqueue", real_enqueue)  # not the fixture's list
    BaseModel.objects.filter(pk=trained.model.base_model_id).update(queue="gpu-small")
    fresh, _ = services.export_create(checkpoint=trained.checkpoint)
    assert services.exports_requeue_orphaned() == []  # queued just now: its message is on its way
    old = timezone.now() - timedelta(seconds=settings.RUN_HEARTBEAT_TIMEOUT_S + 5)
    Export.objects.filter(pk=fresh.pk).update(created_at=old)
    assert services.exports_requeue_orphaned() == [fresh.pk]
    Export.objects.filter(pk=fresh.pk).update(status="running", worker="gone:1", heartbeat_at=old)
    assert services.exports_requeue_orphaned() == [fresh.pk]
    assert sent[-2:] == [((fresh.pk,), "gpu-small"), ((fresh.pk,), "gpu-small")]
    assert services.export_claim(export_id=fresh.pk, worker="new:2").worker == "new:2"  # taken over
    assert services.exports_requeue_orphaned() == []


def test_the_checkpoint_page_links_the_adapter_download(trained, alice_client):
    page = alice_client.get(f"/checkpoints/{trained.checkpoint.pk}/").content.decode()
    link = f"/api/v1/checkpoints/{trained.checkpoint.pk}/adapter/?team=alpha"
    assert link in page
    assert alice_client.get(link)["Content-Type"] == "application/gzip"
    untrained = Checkpoint.objects.get(model=trained.model, step=0)
    assert "Download the adapter" not in alice_client.get(f"/checkpoints/{untrained.pk}/").content.decode()
