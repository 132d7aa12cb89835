"""What the benchmarks on the bundled model share: ``--threads``, ``--tiny`` and ``--cache``, and the
model converted once outside the timings."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from training.base_models import BUNDLED_MODEL, build_tiny_model, load_base_model

ROOT = Path(__file__).resolve().parents[1]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model built here instead of the bundled one"
    )
    parser.add_argument("--cache", default=str(ROOT / "data" / "models"))


def prepared_model(args: argparse.Namespace) -> tuple[Path, str]:
    """(cache folder, model source), with torch's threads set and the model converted and cached."""
    torch.set_num_threads(args.threads)
    cache = Path(args.cache)
    source = str(build_tiny_model(cache / "tiny")) if args.tiny else BUNDLED_MODEL
    load_base_model(source, cache)  # converted once, outside the timings
    return cache, source
