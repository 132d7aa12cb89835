"""The checkpoint folder's format (see training.session.policy): its version, the adapter's file name, its
``state.json``, and the atomic move that makes a folder complete or absent."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

CHECKPOINT_FORMAT_VERSION = 1
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class CheckpointError(ValueError):
    """A directory that is not a readable checkpoint, or one that does not fit the run."""


def read_checkpoint_state(path: Path) -> dict:
    """The `state.json` of a checkpoint directory."""
    state_file = Path(path) / "state.json"
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is not a checkpoint (no state.json)") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{state_file} is not valid JSON: {exc}") from exc
    if state.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {state.get('format_version')!r}")
    return state


def move_into_place(scratch: Path, path: Path) -> None:
    if path.exists():
        # A directory cannot be renamed over a non-empty one: move the old one aside first.
        # Between the two renames `path` is absent, never partial.
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
        os.replace(path, old)
        os.replace(scratch, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(scratch, path)


def as_python_rng_state(state: Any) -> tuple:
    """random.setstate wants tuples; a round trip through torch.save may hand back lists."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
