"""A LoRA adapter trained elsewhere imported as a model's step 0 (POST /api/v1/models/<id>/adapter/):
checked against the base model, resumable bit for bit, and refused with the field named when bad."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from projects import services
from projects.models import Checkpoint
from tests.conftest import error_of
from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.session.policy import Policy

pytestmark = pytest.mark.django_db

SPEC = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture
def adapter_dir(tiny_model_dir, tmp_path) -> Path:
    """A PEFT folder as peft writes it, with trained-looking (non-zero) B matrices."""
    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    trainer = Policy(model, tokenizer, TrainConfig(), SPEC)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    folder = tmp_path / "adapter"
    trainer.save_adapter(folder)
    return folder


def archive(folder: Path, kind: str = "tar", **replace: bytes) -> io.BytesIO:
    files = {p.name: p.read_bytes() for p in folder.iterdir()} | replace
    buffer = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buffer, "w") as z:
            for name, data in files.items():
                z.writestr(f"my-adapter/{name}", data)
    else:
        with tarfile.open(fileobj=buffer, mode="w:gz") as t:
            for name, data in files.items():
                info = tarfile.TarInfo(f"my-adapter/{name}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    buffer.name = f"adapter.{kind}"
    return buffer


@pytest.fixture
def tiny_model(cast, alpha_setup, tiny_model_dir):
    services.base_model_register(name="tiny-local", source=str(tiny_model_dir))
    from projects.models import BaseModel

    base = BaseModel.objects.get(name="tiny-local")
    return services.trainable_model_create(
        project=alpha_setup.project, name="imported", base_model=base, lora={}
    )


def post(key_client, model, data: io.BytesIO):
    return key_client.post(f"/api/v1/models/{model.pk}/adapter/", {"file": data}, format="multipart")


def test_an_imported_adapter_is_step_0_and_resumes_bit_for_bit(
    key_client, tiny_model, adapter_dir, tiny_model_dir
):
    response = post(key_client, tiny_model, archive(adapter_dir, "zip"))
    assert response.status_code == 201, response.json()
    assert response.json()["step"] == 0
    tiny_model.refresh_from_db()
    assert LoraSpec.from_dict(tiny_model.lora) == SPEC
    checkpoint = Checkpoint.objects.get(model=tiny_model, step=0)
    base, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    trainer = Policy.resume(base, tokenizer, Path(checkpoint.path), TrainConfig(), SPEC)
    original = load_file(adapter_dir / "adapter_model.safetensors")
    live = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert len(live) == len(original) == 2 * 2 * 2  # 2 layers × (q, v) × (A, B)
    for name, tensor in original.items():
        (match,) = [p for n, p in live.items() if n.replace(".default", "") == name]
        assert torch.equal(match.detach(), tensor)
    # A second import into the same model is a conflict: step 0 is already that adapter.
    again = post(key_client, tiny_model, archive(adapter_dir))
    assert again.status_code == 409 and error_of(again)["code"] == "model_has_checkpoints"


def test_bad_adapters_are_refused_naming_the_field(key_client, tiny_model, adapter_dir):
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    cases = [
        ({"adapter_model.safetensors": b""}, "file", "cannot be read"),
        ({"adapter_config.json": json.dumps({**config, "r": 8}).encode()}, "adapter_config.r", "rank 4"),
        (
            {"adapter_config.json": json.dumps({**config, "use_dora": True}).encode()},
            "adapter_config.use_dora",
            "DoRA",
        ),
        (
            {"adapter_config.json": json.dumps({**config, "target_modules": ["q_proj"]}).encode()},
            "file",
            "v_proj",
        ),
        ({"adapter_config.json": b"{nope"}, "file", "not JSON"),
    ]
    wide = dict(weights)
    (name,) = [n for n in wide if "layers.0" in n and "q_proj.lora_A" in n]
    wide[name] = torch.zeros(4, wide[name].shape[1] + 1)
    save_file(wide, str(adapter_dir.parent / "wide.safetensors"))
    cases.append(({"adapter_model.safetensors": (adapter_dir.parent / "wide.safetensors").read_bytes()}, "file",
                  "does not fit the base model"))  # fmt: skip
    for replace, field, words in cases:
        response = post(key_client, tiny_model, archive(adapter_dir, **replace))
        assert response.status_code == 400, (field, response.json())
        assert error_of(response)["param"] == field and words in error_of(response)["message"], (
            response.json()
        )
    pickled = io.BytesIO()
    with zipfile.ZipFile(pickled, "w") as z:
        z.writestr("adapter_config.json", json.dumps(config))
        z.writestr("adapter_model.bin", b"\x80\x04")
    pickled.seek(0)
    pickled.name = "a.zip"
    response = post(key_client, tiny_model, pickled)
    assert response.status_code == 400 and "pickle" in error_of(response)["message"]
    junk = io.BytesIO(b"not an archive at all")
    junk.name = "a.tgz"
    assert post(key_client, tiny_model, junk).status_code == 400
    assert not Checkpoint.objects.filter(model=tiny_model).exists()


def test_a_read_only_key_cannot_import(read_only_client, tiny_model, adapter_dir):
    response = read_only_client.post(f"/api/v1/models/{tiny_model.pk}/adapter/", {"file": archive(adapter_dir)},
                                     format="multipart")  # fmt: skip
    assert response.status_code == 403
