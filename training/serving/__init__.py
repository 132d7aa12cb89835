"""The inference server: an OpenAI-compatible HTTP API for one base model plus LoRA checkpoints.

- `protocol`: the wire between gateway and server, and parsing and validating
  `/v1/chat/completions` bodies (no torch, no Django: the gateway validates with it too);
  `responses` renders sampled choices (content or tool calls) into completion bodies and
  `chunks` into stream chunks. Error objects come from `training.wire.openai_errors`.
- `prompts`: render a request's messages (and tools) to prompt token ids with the chat template.
- `adapters`: the least-recently-used set of LoRA adapters loaded into the engine.
- `scheduler`: collects concurrent requests and runs one batched generation per compatible group,
  passing each sampled token back to a streaming request as it comes.
- `app`: the ASGI application; `server`: binds, runs it under uvicorn and heartbeats.
- `vllm`: builds the command of vLLM's own OpenAI server with LoRA (from this interpreter or from
  vLLM's own virtualenv), starts and supervises it, or starts one private to a run (`LocalVLLM`);
  the gateway loads adapters into it (projects.gateway.vllm). Tested against the real vLLM's CPU
  build (tests/vllm) and, for failures on demand, a protocol double.

Nothing here imports Django; `manage.py serve_inference` passes settings and the registration
callback in. Importing this package imports neither torch nor uvicorn.
"""
