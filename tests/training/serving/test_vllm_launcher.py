"""What the vLLM launcher builds (the launch itself runs against a protocol double in
test_vllm_live.py, and against the real vLLM only in its gpu-marked test)."""

from __future__ import annotations

from pathlib import Path

from training.serving.vllm import VLLMServeOptions, load_adapter_call, unload_adapter_call, vllm_serve_command

EXECUTABLE = ["/venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]


def test_vllm_serve_command_enables_runtime_lora_and_hermes_tools():
    command, env = vllm_serve_command(
        VLLMServeOptions(
            model_dir=Path("/models/qwen"), served_model_name="qwen", port=8200, max_loras=4, api_key="secret"
        ),
        EXECUTABLE,
    )
    joined = " ".join(command)
    assert "--model /models/qwen" in joined
    for flag in ("--enable-lora", "--max-loras 4", "--port 8200", "--served-model-name qwen",
                 "--tool-call-parser hermes", "--enable-auto-tool-choice",
                 # a run's rollouts train on these logprobs: the trainer's convention (after temperature)
                 "--logprobs-mode processed_logprobs"):  # fmt: skip
        assert flag in joined
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_the_server_token_is_in_the_environment_never_on_the_command_line():
    """Any local process reads /proc/<pid>/cmdline, and serve_inference logs the command line."""
    command, env = vllm_serve_command(
        VLLMServeOptions(model_dir=Path("/m"), served_model_name="m", api_key="tok-123"), EXECUTABLE
    )
    assert not any("tok-123" in argument for argument in command)
    assert "--api-key" not in command
    assert env["VLLM_API_KEY"] == "tok-123"


def test_an_executable_override_keeps_the_arguments():
    options = VLLMServeOptions(model_dir=Path("/models/qwen"), served_model_name="qwen")
    command, _ = vllm_serve_command(options, ["python", "fake_vllm.py"])
    assert command[:4] == ["python", "fake_vllm.py", "--model", "/models/qwen"]


def test_adapter_load_and_unload_calls_follow_vllms_runtime_lora_api():
    load = load_adapter_call("model-3-step-7", Path("/data/checkpoints/model-3/step-7"))
    assert (load.method, load.path) == ("POST", "/v1/load_lora_adapter")
    assert load.json == {"lora_name": "model-3-step-7", "lora_path": "/data/checkpoints/model-3/step-7"}
    assert unload_adapter_call("model-3-step-7").json == {"lora_name": "model-3-step-7"}
