"""Exporting a trained adapter: the adapter alone (PEFT-loadable) or merged into the base weights
(a plain Hugging Face model folder), each with a model card, packed as a tar.gz archive.

    merged = merge_adapter(base_model, adapter_dir)     # peft merge_and_unload, weights in place
    save_merged(merged, tokenizer, out_dir, card=...)   # safetensors + config + tokenizer + README.md
    write_archive(fileobj, adapter_dir, names=ADAPTER_FILES, extra={"README.md": card})
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from training.session.checkpoint_files import ADAPTER_WEIGHTS

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)


def merge_adapter(base_model: Any, adapter_dir: Path) -> Any:
    """``base_model`` with the LoRA adapter in ``adapter_dir`` merged into its weights: the same
    function as base + adapter, with no peft at inference time. Modifies ``base_model``."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(base_model, str(adapter_dir), is_trainable=False)
    return peft_model.merge_and_unload()


def save_merged(model: Any, tokenizer: Any, out_dir: Path, *, card: str) -> None:
    """A Hugging Face folder ``AutoModelForCausalLM.from_pretrained`` loads: safetensors weights,
    config.json, generation config, tokenizer files and the model card (README.md)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "README.md").write_text(card)


def model_card(
    *,
    title: str,
    base_model: str,
    step: int,
    kind: str,
    lora: dict[str, Any],
    run_config: dict[str, Any] | None,
    metrics: dict[str, Any],
    evaluations: list[dict[str, Any]],
) -> str:
    """A README.md (Hugging Face model card front matter + what it is and how it was trained)."""
    how = (
        "Load with peft:\n\n```python\nfrom peft import PeftModel\nfrom transformers import "
        "AutoModelForCausalLM\n\nbase = AutoModelForCausalLM.from_pretrained(BASE_MODEL_DIR)\n"
        "model = PeftModel.from_pretrained(base, THIS_DIR)\n```\n"
        if kind == "adapter"
        else "Load with transformers:\n\n```python\nfrom transformers import AutoModelForCausalLM, "
        "AutoTokenizer\n\nmodel = AutoModelForCausalLM.from_pretrained(THIS_DIR)\ntokenizer = "
        "AutoTokenizer.from_pretrained(THIS_DIR)\n```\n"
    )
    lines = [
        "---",
        f"base_model: {json.dumps(base_model)}",
        "library_name: " + ("peft" if kind == "adapter" else "transformers"),
        "tags: [artweb, grpo, lora]",
        "---",
        "",
        f"# {title}",
        "",
        f"{'LoRA adapter' if kind == 'adapter' else 'Merged weights (LoRA adapter merged into the base)'} "
        f"trained with GRPO by artweb: checkpoint **step {step}** on base model `{base_model}`.",
        "",
        how,
        "## LoRA",
        "",
        "```json",
        json.dumps(lora, indent=2, sort_keys=True),
        "```",
        "",
        "## Run configuration",
        "",
        "```json",
        json.dumps(run_config, indent=2, sort_keys=True) if run_config else "(no run recorded this step)",
        "```",
        "",
        "## Step metrics",
        "",
    ]
    numbers = {
        k: v for k, v in sorted(metrics.items()) if isinstance(v, int | float) and not isinstance(v, bool)
    }
    lines += [f"- {name}: {value:.6g}" for name, value in numbers.items()] or ["(none recorded)"]
    lines += ["", "## Evaluations", ""]
    if not evaluations:
        lines.append("(none)")
    for evaluation in evaluations:
        results = evaluation.get("results") or {}
        figures = ", ".join(
            f"{name} {results[name]:.4g}"
            for name in ("mean_reward", "pass_rate", "win_rate")
            if isinstance(results.get(name), int | float)
        )
        lines.append(
            f"- evaluation {evaluation['id']} ({evaluation['split']} split): {figures or 'no figures'}"
        )
    return "\n".join(lines) + "\n"


def write_archive(
    fileobj: BinaryIO,
    folder: Path | None,
    *,
    names: Iterable[str] | None = None,
    extra: dict[str, str] | None = None,
) -> None:
    """A tar.gz of ``folder``'s files (only ``names`` when given; all, recursively, otherwise) plus
    ``extra`` text files, every entry at the archive's top level (``tar xzf`` gives a loadable dir).
    Symlinks are left out: archived as links they would point the unpacker at its own files."""
    with tarfile.open(fileobj=fileobj, mode="w:gz") as archive:
        if folder is not None:
            folder = Path(folder)
            paths = [folder / name for name in names] if names is not None else sorted(folder.rglob("*"))
            for path in paths:
                if path.is_file() and not path.is_symlink() and path.name not in (extra or {}):
                    archive.add(str(path), arcname=path.relative_to(folder).as_posix(), recursive=False)
        for name, text in (extra or {}).items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
