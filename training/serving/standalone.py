"""An inference server without the platform: no registry, no heartbeat, no store (checkpoints are
named by their folder under ``--adapter-root``). For benchmarks and tests that need a server process
of their own; the platform's is ``manage.py serve_inference``. The token comes from
``INFERENCE_SERVER_TOKEN`` in the environment, never from the command line; without one it refuses
to start, unless ``--dev-no-token`` on a loopback ``--host``.

    python -m training.serving.standalone --model bundled:smollm2-135m-instruct --adapter-root /tmp
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from training.serving.binding import add_dev_no_token_argument, check_bind_or_exit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a base model source (bundled:… or a folder)")
    parser.add_argument(
        "--cache-dir", type=Path, required=True, help="where converted base models are cached"
    )
    parser.add_argument(
        "--adapter-root", type=Path, required=True, help="only checkpoints under it are loaded"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda[:N] (bf16 on a GPU that has it, else fp32)"
    )
    add_dev_no_token_argument(parser, token_variable="INFERENCE_SERVER_TOKEN")
    args = parser.parse_args(argv)
    token = os.environ.get("INFERENCE_SERVER_TOKEN", "")
    check_bind_or_exit(
        parser, args, token=token, token_variable="INFERENCE_SERVER_TOKEN", what="the inference server"
    )
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from training.base_models import load_base_model
    from training.engines.transformers_engine import TransformersEngine
    from training.serving.app import InferenceApp, ServerConfig
    from training.serving.server import advertised_url, bind, serve

    model, tokenizer = load_base_model(args.model, args.cache_dir, device=args.device)
    model.to(args.device)  # loaded on the CPU (training.base_models)
    config = ServerConfig(
        model_name=args.model,
        adapter_root=args.adapter_root,
        token=token,
    )
    app = InferenceApp(TransformersEngine(model, tokenizer, device=args.device), config)
    sock = bind(args.host, args.port)
    url = advertised_url(args.host, sock.getsockname()[1])
    print(f"inference server on {url}", flush=True)
    serve(app, sock=sock, url=url, token=token)


if __name__ == "__main__":
    main()
