"""The OpenAI-compatible gateway (``/v1/…``): team API keys in, routed to a live inference server.

- ``views``: the async Django views (run under ASGI so streams pass through unbuffered).
- ``routing``: model id -> checkpoint (team-scoped) and the live servers of its base model.
- ``upstream``: the servers' dialects behind one ``send`` / ``relay`` / ``answer`` interface: our
  inference server there, vLLM's in ``vllm`` (which also loads checkpoints' adapters into it).
- ``http``: a small keep-alive HTTP/1.1 client over asyncio streams, to the servers.
- ``errors``: ``GatewayError``, OpenAI's error object (types from training.wire.openai_errors).
- ``ratelimit``: requests per minute per API key.
- ``services``: the writes (server registration and heartbeat, usage records).
"""
