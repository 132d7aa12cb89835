"""A LoRA adapter trained elsewhere (a PEFT folder, uploaded as a .zip or .tar[.gz] archive) checked
before it becomes a model's step 0.

What is read: ``adapter_config.json`` and ``adapter_model.safetensors`` (anywhere in the archive,
by name; nothing else is extracted, so no member's path can escape). What is refused, with the field
named: a pickle-only adapter (``adapter_model.bin``), a non-LoRA PEFT method, LoRA variants the
trainer does not reproduce (DoRA, rsLoRA, per-module ranks, extra trained modules, biases), tensors
whose rank or shape disagree with the config, and — where the base model's ``config.json`` is on
this host, for Llama-style models — shapes that do not fit the base model's layers.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import zipfile
from dataclasses import dataclass
from typing import Any

from training.config import ConfigError, LoraSpec

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_LORA_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w.]*\.)?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterImportError(ValueError):
    """An archive that cannot be a model's step 0; ``field`` says where (``file`` or a config key)."""

    def __init__(self, message: str, field: str = "file") -> None:
        super().__init__(message)
        self.field, self.message = field, message


@dataclass
class Adapter:
    config: dict[str, Any]  # adapter_config.json as given
    weights: bytes  # adapter_model.safetensors as given
    lora: LoraSpec


def read_archive(data: bytes, *, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """``adapter_config.json`` (parsed) and ``adapter_model.safetensors`` (bytes) of a zip or tar
    archive, each at most ``max_bytes`` uncompressed."""
    files: dict[str, bytes] = {}
    names: list[str] = []
    wanted = (CONFIG_FILE, WEIGHTS_FILE)
    try:
        if zipfile.is_zipfile(io.BytesIO(data)):
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for info in archive.infolist():
                    name = info.filename.rsplit("/", 1)[-1]
                    names.append(name)
                    if name in wanted and not info.is_dir():
                        _fits(name, info.file_size, max_bytes)
                        files[name] = archive.read(info)
        else:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
                for member in archive.getmembers():
                    name = member.name.rsplit("/", 1)[-1]
                    names.append(name)
                    if name in wanted and member.isfile():
                        _fits(name, member.size, max_bytes)
                        handle = archive.extractfile(member)
                        files[name] = handle.read() if handle is not None else b""
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise AdapterImportError(f"not a .zip or .tar(.gz) archive of a PEFT adapter folder: {exc}") from None
    if WEIGHTS_FILE not in files:
        pickled = " (adapter_model.bin is a pickle, which is not loaded here: save with safe_serialization)" if (
            "adapter_model.bin" in names) else ""  # fmt: skip
        raise AdapterImportError(f"the archive has no {WEIGHTS_FILE}{pickled}")
    if CONFIG_FILE not in files:
        raise AdapterImportError(f"the archive has no {CONFIG_FILE}")
    try:
        config = json.loads(files[CONFIG_FILE])
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterImportError(f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterImportError(f"{CONFIG_FILE} must hold a JSON object")
    return config, files[WEIGHTS_FILE]


def _fits(name: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise AdapterImportError(f"{name} is {size} bytes, more than the {max_bytes} allowed")


def lora_spec(config: dict[str, Any]) -> LoraSpec:
    """The LoraSpec an adapter_config.json describes, or AdapterImportError naming the key."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterImportError(
            f"a {config.get('peft_type')} adapter: only LoRA adapters train here", "peft_type"
        )
    refused = {
        "use_dora": "DoRA", "use_rslora": "rsLoRA scaling", "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas", "modules_to_save": "extra trained modules",
        "layers_to_transform": "a subset of layers",
    }  # fmt: skip
    for key, what in refused.items():
        if config.get(key):
            raise AdapterImportError(
                f"{what} ({key}) is not supported: the trainer would not reproduce it", key
            )
    if config.get("bias", "none") != "none":
        raise AdapterImportError("trained biases are not supported (bias must be 'none')", "bias")
    modules = config.get("target_modules")
    if isinstance(modules, str):
        raise AdapterImportError("target_modules as a regular expression is not supported: list the modules", "target_modules")  # fmt: skip
    try:
        return LoraSpec.from_dict(
            {
                "rank": config.get("r"),
                "alpha": config.get("lora_alpha"),
                "dropout": config.get("lora_dropout", 0.0),
                "target_modules": sorted(modules) if isinstance(modules, list) else modules,
            }  # fmt: skip
        )
    except ConfigError as exc:
        key = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}.get(exc.field, exc.field)
        raise AdapterImportError(f"{key}: {exc.message}", key) from None


def _expected_shapes(base: dict[str, Any]) -> dict[str, tuple[int, int]] | None:
    """(in, out) features of a Llama-style block's projections from the base model's config.json."""
    try:
        hidden, inter = int(base["hidden_size"]), int(base["intermediate_size"])
        heads = int(base["num_attention_heads"])
        kv_heads = int(base.get("num_key_value_heads") or heads)
        head_dim = int(base.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip


def check_adapter(config: dict[str, Any], weights: bytes, base_config: dict[str, Any] | None) -> Adapter:
    """The adapter, once its tensors agree with its config and (where known) with the base model."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    lora = lora_spec(config)
    try:
        tensors = load(weights)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterImportError(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    if not tensors:
        raise AdapterImportError(f"{WEIGHTS_FILE} holds no tensors")
    shapes = _expected_shapes(base_config or {}) if base_config else None
    layers = int(base_config.get("num_hidden_layers", 0)) if base_config else 0
    seen: set[str] = set()
    for name, tensor in tensors.items():
        match = _LORA_KEY.search(name)
        if match is None or tensor.dim() != 2:
            raise AdapterImportError(f"{WEIGHTS_FILE}: {name!r} is not a LoRA A or B matrix of a layer")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if module not in lora.target_modules:
            raise AdapterImportError(
                f"{WEIGHTS_FILE}: {name!r} adapts {module}, which target_modules does not list"
            )
        rank = tensor.shape[0] if side == "A" else tensor.shape[1]
        if rank != lora.rank:
            raise AdapterImportError(
                f"{WEIGHTS_FILE}: {name!r} has rank {rank}, the config says r={lora.rank}", "r"
            )
        if layers and layer >= layers:
            raise AdapterImportError(
                f"{WEIGHTS_FILE}: {name!r} adapts layer {layer}; the base model has {layers}"
            )
        if shapes is not None and module in shapes:
            features = shapes[module][0] if side == "A" else shapes[module][1]
            got = tensor.shape[1] if side == "A" else tensor.shape[0]
            if got != features:
                raise AdapterImportError(
                    f"{WEIGHTS_FILE}: {name!r} has shape {tuple(tensor.shape)}, which does not fit the base "
                    f"model's {module} ({features} features): an adapter of another base model?"
                )
        seen.add(module)
    missing = sorted(set(lora.target_modules) - seen)
    if missing:
        raise AdapterImportError(
            f"{WEIGHTS_FILE} has no weights for {', '.join(missing)} (listed in target_modules)"
        )
    return Adapter(config=config, weights=weights, lora=lora)
