"""The GPU path is not run here (vLLM needs CUDA); these check what its launcher builds."""

from __future__ import annotations

from pathlib import Path

from training.serving.adapters import adapter_name
from training.serving.vllm import VLLMServeOptions, load_adapter_call, unload_adapter_call, vllm_serve_command


def test_vllm_serve_command_enables_runtime_lora_and_hermes_tools():
    command, env = vllm_serve_command(
        VLLMServeOptions(
            model_dir=Path("/models/qwen"), served_model_name="qwen", port=8200, max_loras=4, api_key="secret"
        )  # fmt: skip
    )
    joined = " ".join(command)
    assert "serve /models/qwen" in joined
    for flag in ("--enable-lora", "--max-loras 4", "--port 8200", "--served-model-name qwen",
                 "--tool-call-parser hermes", "--enable-auto-tool-choice", "--api-key secret"):  # fmt: skip
        assert flag in joined
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_adapter_load_and_unload_calls_name_the_checkpoint_like_the_cpu_server():
    path = Path("/data/checkpoints/model-3/step-7")
    load = load_adapter_call(path)
    assert (load.method, load.path) == ("POST", "/v1/load_lora_adapter")
    assert load.json == {"lora_name": adapter_name(path), "lora_path": str(path)}
    assert unload_adapter_call(path).json == {"lora_name": adapter_name(path)}
