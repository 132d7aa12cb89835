"""A data-parallel follower process: ``python -m training.hosting.follower <read fd> <write fd>`` (started by
training.hosting.followers.Followers; its orders come down the pipe, see there). A follower loads the base,
resumes rank 0's checkpoint and then runs what rank 0 runs: a mirrored session's primitives, the
GRPO update, a probe of a saved policy."""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.engines.vllm_engine import render_prompt
from training.hosting.followers import Duplex, FollowerSpec
from training.hosting.ranks import COLLECTIVE_TIMEOUT_S, DataParallelSession, log, rank_device, shard_base
from training.session.adapter_check import next_token_logprobs, probe_saved
from training.session.local import TrainingSession
from training.session.policy import Policy, load_policy_model


def follower_main(read_fd: int, write_fd: int) -> None:
    """The follower process: read its orders from rank 0 (see ``Followers``) and follow them."""
    pipe = Duplex(Connection(read_fd, writable=False), Connection(write_fd, readable=False))
    try:
        message = pipe.recv()
    except EOFError:
        return
    _, rank, world_size, rendezvous, backend, spec, parent_pid = message
    _follow(rank, world_size, rendezvous, backend, spec, pipe, parent_pid)


def _follow(rank: int, world_size: int, rendezvous: str, backend: str, spec: FollowerSpec, pipe: Any,
            parent_pid: int) -> None:  # fmt: skip
    device = rank_device(spec.device, rank)
    threads = int(os.environ.get("TORCH_THREADS") or 0) or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip
        base_model, tokenizer, _ = load_policy_model(spec.base_model_source, spec.model_cache_dir, device=device,
                                                     unsloth=spec.unsloth, fsdp=spec.config.fsdp)  # fmt: skip
        trainer = Policy.resume(base_model, tokenizer, spec.checkpoint, spec.config, spec.lora, device=device)
        mirrored: DataParallelSession | None = None
        pipe.send(("ready",))
        while True:
            if not pipe.poll(1.0):
                if os.getppid() != parent_pid:  # the worker died: nobody will send work again
                    return
                continue
            message = pipe.recv()
            if message[0] == "stop":
                return
            if message[0] == "call":  # a MirroredSession's primitive, on this rank's share
                _, name, args, kwargs = message
                if mirrored is None:
                    mirrored = DataParallelSession(TrainingSession(trainer))
                try:
                    getattr(mirrored, name)(*args, **kwargs)
                except Exception as exc:
                    if not getattr(exc, "raised_on_every_rank", False):
                        raise
                    # Bad input: rank 0 answers its caller; the ranks are in step for the next call.
                continue
            if message[0] == "probe":  # rank 0 probes a saved policy (Followers.probe): with every rank
                _, probes, saved = message
                shard_base(trainer)  # sharded already, unless no update has run since this rank started
                if saved is not None:  # an earlier checkpoint's adapter, for the probe only
                    probe_saved(trainer, tokenizer, Path(saved), probes)
                else:
                    for messages in probes:
                        next_token_logprobs(trainer.policy, render_prompt(tokenizer, messages))
                continue
            if message[0] == "configure":  # the session's settings from now on (SessionPool.configure)
                trainer.config = message[1]
                continue
            raise RuntimeError(f"data-parallel rank {rank} got an unknown order: {message[0]!r}")
    except (EOFError, BrokenPipeError):
        return
    except Exception as exc:  # told to rank 0 when it waits for "ready"; logged either way
        log.exception("data-parallel rank %d failed", rank)
        with contextlib.suppress(BrokenPipeError, OSError):
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    follower_main(int(sys.argv[1]), int(sys.argv[2]))
