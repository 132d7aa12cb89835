"""Thinking Machines' ``tinker`` SDK (0.38, unchanged) trains on a live artweb: web under uvicorn,
a real Celery worker, the host's trainer service, the tiny model, no network.

The SDK is pointed at ``<artweb>/tinker`` with ``tml-`` + a team key. An SFT loop
(``cross_entropy``) makes the held-out loss fall; an RL loop (sample → score → ``importance_sampling``
→ ``optim_step`` → a new sampler) makes the reward rise; each ``optim_step`` is a step of a run of
kind ``tinker``; a sampler checkpoint answers through ``/v1/chat/completions`` at once; another
team's key sees nothing and a read-only key cannot train.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunKind, StepMetrics
from tests.conftest import trainer_service
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    gateway,
    http,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ANSWER = "ok"  # what the SFT data teaches after any prompt


def _sft_datum(types: Any, tokenizer: Any, prompt: str) -> Any:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt_ids + answer_ids
    weights = [0.0] * len(prompt_ids) + [1.0] * len(answer_ids)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )


def _prompts(rng: random.Random, count: int) -> list[str]:
    return ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8))) + ":" for _ in range(count)]


def _mean_loss(output: Any, data: list[Any]) -> float:
    """Per-token cross entropy over the weighted tokens, from the logprobs the API returned."""
    total, count = 0.0, 0.0
    for datum, result in zip(data, output.loss_fn_outputs, strict=True):
        weights = datum.loss_fn_inputs["weights"].tolist()
        logprobs = result["logprobs"].tolist()
        total -= sum(w * lp for w, lp in zip(weights, logprobs, strict=True))
        count += sum(weights)
    return total / count


def test_the_tinker_sdk_trains_on_artweb_unchanged(gateway, serving, start_worker, tiny_model_dir, cast):  # noqa: F811
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    register_base_model(tiny_model_dir)
    key = services.api_key_create(team=cast.alpha, name="tinker").plaintext
    outsider = services.api_key_create(team=cast.beta, name="outsider").plaintext
    reader = services.api_key_create(team=cast.alpha, name="reader", read_only=True).plaintext
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    train = [_sft_datum(types, tokenizer, p) for p in _prompts(rng, 8)]
    held_out = [_sft_datum(types, tokenizer, p) for p in _prompts(rng, 8)]

    with trainer_service(
        serving.data_dir / "checkpoints", tiny_model_dir.parent, token="t-tinker"
    ) as service:
        worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=service.url,
                              TRAINER_SERVICE_TOKEN="t-tinker", TINKER_POLL_S="5")  # fmt: skip
        client = tinker.ServiceClient(base_url=f"{gateway.url}/tinker", api_key=f"tml-{key}")
        capabilities = client.create_rest_client().get_server_capabilities().result()
        names = [m.model_name for m in capabilities.supported_models]
        assert BASE_MODEL in names

        # ---- SFT: cross_entropy on the answer's tokens; the held-out loss falls.
        trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
        assert trainer.get_info().model_data.model_name == BASE_MODEL
        before = _mean_loss(trainer.forward(held_out, "cross_entropy").result(), held_out)
        losses = []
        started = time.monotonic()
        for _ in range(6):
            backward = trainer.forward_backward(train, "cross_entropy")
            step = trainer.optim_step(types.AdamParams(learning_rate=2e-2))
            losses.append(_mean_loss(backward.result(), train))
            step.result()
        seconds_per_step = (time.monotonic() - started) / 6
        after = _mean_loss(trainer.forward(held_out, "cross_entropy").result(), held_out)
        print(f"SFT held-out loss {before:.3f} -> {after:.3f}; train {[round(v, 3) for v in losses]}; "
              f"{seconds_per_step:.3f} s per forward_backward + optim_step through the SDK")  # fmt: skip
        assert after < before - 0.5, (before, after)
        assert losses[-1] < losses[0]

        saved = trainer.save_weights_for_sampler(name="sft-final").result()
        assert saved.path.endswith("/sampler_weights/sft-final")
        state = trainer.save_state(name="sft-state").result()
        assert state.path.startswith("tinker://")

        # The training client is a run of kind tinker: six steps charted, a checkpoint at step 6.
        run = Run.objects.get(kind=RunKind.TINKER, project__team=cast.alpha)
        assert list(
            StepMetrics.objects.filter(run=run).order_by("step").values_list("step", flat=True)
        ) == list(range(1, 7))
        assert all(m.loss and m.loss > 0 for m in StepMetrics.objects.filter(run=run))
        checkpoint = Checkpoint.objects.get(model=run.model, step=6)
        assert checkpoint.storage_key and {"sampler_weights/sft-final", "weights/sft-state"} <= set(
            checkpoint.metrics["tinker_names"]
        )
        # ... served at once by the gateway under its platform name.
        name = f"{run.project.name}/{run.model.name}:6"
        status, _, reply = http("POST", f"{gateway.url}/v1/chat/completions", key=key, body={
            "model": name, "messages": [{"role": "user", "content": "abc:"}], "max_tokens": 4,
        })  # fmt: skip
        assert status == 200, reply

        # Checkpoints listed and deleted through the SDK's RestClient: a name goes; the checkpoint
        # stays while another name holds it, and the model's latest step is never deleted.
        rest = tinker.RestClient(base_url=f"{gateway.url}/tinker", api_key=f"tml-{key}")
        listed = {c.checkpoint_id for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
        assert listed == {"sampler_weights/sft-final", "weights/sft-state"}
        rest.delete_checkpoint(trainer.model_id, "weights/sft-state").result()
        listed = {c.checkpoint_id for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
        assert listed == {"sampler_weights/sft-final"}
        with pytest.raises(tinker.APIStatusError) as refused:
            rest.delete_checkpoint(trainer.model_id, "sampler_weights/sft-final").result()
        assert refused.value.status_code == 400 and "cannot be deleted" in str(refused.value)
        assert Checkpoint.objects.filter(model=run.model, step=6).exists()

        # A sampler on the saved weights: the answer it learned comes first.
        sampler = client.create_sampling_client(model_path=saved.path)
        prompt = types.ModelInput.from_ints(tokenizer.encode("hij:", add_special_tokens=False))
        first = tokenizer.encode(ANSWER, add_special_tokens=False)[0]
        sampled = sampler.sample(prompt, num_samples=4, sampling_params=types.SamplingParams(
            max_tokens=3, temperature=0.0)).result()  # fmt: skip
        assert len(sampled.sequences) == 4
        assert all(
            seq.tokens[0] == first and len(seq.logprobs) == len(seq.tokens) for seq in sampled.sequences
        )

        # ---- Tenancy: another team's key finds nothing; a read-only key cannot train.
        other = tinker.ServiceClient(base_url=f"{gateway.url}/tinker", api_key=f"tml-{outsider}")
        with pytest.raises(tinker.NotFoundError):
            other.create_sampling_client(model_path=saved.path).sample(
                prompt, 1, types.SamplingParams(max_tokens=2)
            ).result()
        status, reply = _post(gateway.url, "get_info", {"model_id": trainer.model_id}, f"tml-{outsider}")
        assert status == 404, reply
        status, reply = _post(gateway.url, "optim_step", {"model_id": trainer.model_id, "seq_id": 99,
                              "adam_params": {"learning_rate": 1e-3}}, f"tml-{reader}")  # fmt: skip
        assert status == 403 and "read-only" in reply["error"]["message"]

        # ---- Two teams' clients interleave on the one base: same data and seed, so each must get
        # exactly the losses the other gets (the trainer service swaps adapters and optimizers).
        ours = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result()
        theirs = other.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result()
        pairs = []
        for _ in range(3):
            futures = [(c.forward_backward(train, "cross_entropy"), c.optim_step(types.AdamParams(learning_rate=2e-2)))
                       for c in (ours, theirs)]  # fmt: skip
            pairs.append(tuple(_mean_loss(fb.result(), train) for fb, _ in futures))
            for _, step in futures:
                step.result()
        assert all(a == b for a, b in pairs) and pairs[-1][0] < pairs[0][0], pairs
        assert Run.objects.filter(kind=RunKind.TINKER, project__team=cast.beta).count() == 1

        # ---- RL: sample a group, score it, importance_sampling on the centred rewards.
        rl = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
        rewards = []
        prompt_ids = tokenizer.encode("go:", add_special_tokens=False)
        for _ in range(10):
            policy = rl.save_weights_and_get_sampling_client()
            group = policy.sample(types.ModelInput.from_ints(prompt_ids), num_samples=16,
                                  sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, top_k=4)).result()  # fmt: skip
            scores = [sum(t % 2 == 0 for t in seq.tokens) / len(seq.tokens) for seq in group.sequences]
            rewards.append(statistics.mean(scores))
            baseline, spread = statistics.mean(scores), statistics.pstdev(scores) + 1e-6
            data = []
            for seq, score in zip(group.sequences, scores, strict=True):
                tokens = prompt_ids + list(seq.tokens)
                n = len(prompt_ids) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * n + list(seq.logprobs),
                        "advantages": [0.0] * n + [(score - baseline) / spread] * len(seq.tokens),
                    },
                ))  # fmt: skip
            rl.forward_backward(data, "importance_sampling").result()
            rl.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        print(f"RL reward per step {[round(r, 3) for r in rewards]}")
        assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:2]) + 0.15, rewards
        stats = service.stats()
        client.close(
            "success"
        )  # as a `with tinker.ServiceClient(...)` block's end does: the session's runs end
    assert stats["base_loads"] == 1, stats  # every session (SFT, RL, the samplers) on one base
    assert set(
        Run.objects.filter(kind=RunKind.TINKER, project__team=cast.alpha).values_list("status", flat=True)
    ) == {"succeeded"}
    assert "Traceback" not in worker.output()


def _post(url: str, route: str, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{url}/tinker/api/v1/{route}", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("X-API-Key", key)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_tinker_and_platform_runs_continue_each_others_checkpoints(
    gateway,  # noqa: F811  (the fixture imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
):
    """A Tinker-trained adapter starts a platform run (``start_from`` its latest checkpoint), and
    that run's checkpoint loads into a new Tinker training client with exactly its weights."""
    import tinker
    from rest_framework.test import APIClient
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.config import LoraSpec, TrainConfig
    from training.session.contract import Datum
    from training.session.local import TrainingSession

    register_base_model(tiny_model_dir)
    key = services.api_key_create(team=cast.alpha, name="mixed").plaintext
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    project = api.post("/api/v1/projects/", {"name": "mixed"}, format="json").json()["id"]
    rows = [{"prompt": f"Say {word}", "item": {"answer": word}} for word in ["a", "b", "c", "d"]]
    inputs = {
        "task_set": api.post("/api/v1/task-sets/", {"project": project, "name": "words", "rows": rows}, format="json"),
        "environment": api.post("/api/v1/environments/", {"project": project, "name": "chat"}, format="json"),
        "reward": api.post("/api/v1/reward-definitions/", {"project": project, "name": "has-a",
                           "spec": {"type": "regex", "pattern": "a"}}, format="json"),
    }  # fmt: skip
    assert all(r.status_code == 201 for r in inputs.values()), {k: r.json() for k, r in inputs.items()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = [_sft_datum(types, tokenizer, p) for p in _prompts(random.Random(1), 4)]

    with trainer_service(serving.data_dir / "checkpoints", tiny_model_dir.parent, token="t-mixed") as service:
        start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=service.url,
                     TRAINER_SERVICE_TOKEN="t-mixed", TINKER_POLL_S="5")  # fmt: skip
        client = tinker.ServiceClient(
            base_url=f"{gateway.url}/tinker", api_key=f"tml-{key}", project_id="mixed"
        )
        trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
        for _ in range(2):
            trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=2e-2))
        trainer.save_state(name="handoff").result()
        model = Run.objects.get(kind=RunKind.TINKER, project__name="mixed").model

        # The platform run continues the Tinker-trained adapter from its latest checkpoint (step 2).
        body = {"model": model.pk, **{k: r.json()["id"] for k, r in inputs.items()},
                "config": {"group_size": 4, "groups_per_step": 1, "max_new_tokens": 6, "steps": 1}}  # fmt: skip
        response = api.post("/api/v1/runs/", body, format="json")
        assert response.status_code == 201, response.json()
        run_id = response.json()["id"]
        deadline = time.monotonic() + 240
        while (
            Run.objects.get(pk=run_id).status not in ("succeeded", "failed") and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        run = Run.objects.get(pk=run_id)
        assert run.status == "succeeded", run.error
        assert run.start_step == 2 and run.current_step == 3
        platform = Checkpoint.objects.get(model=model, step=3)

        # ... and its checkpoint is a Tinker training client's state.
        loaded = client.create_training_client_from_state(f"tinker://mixed.{model.name}/step/3").result()
        output = loaded.forward(data, "cross_entropy").result()

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    local = TrainingSession.load_state(
        base, tokenizer, Path(platform.path), TrainConfig(), LoraSpec.from_dict(model.lora)
    )
    datums = [Datum(model_input=d.model_input.to_ints(),
                    loss_fn_inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()}) for d in data]  # fmt: skip
    expected = local.forward(datums)
    for got, want in zip(output.loss_fn_outputs, expected, strict=True):
        assert got["logprobs"].tolist() == pytest.approx(want, abs=1e-5)


def test_a_training_client_goes_on_unchanged_after_the_trainer_service_is_killed(
    gateway,  # noqa: F811  (the fixture imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
):
    """The trainer service holding a session is SIGKILLed between a ``forward_backward`` and its
    ``optim_step`` and started again: the SDK's next calls succeed and give exactly the losses of a
    client that was never interrupted (the session is rebuilt: projects.jobs.tinker_recovery)."""
    import socket

    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from projects.models import RunEvent, TinkerModel

    register_base_model(tiny_model_dir)
    key = services.api_key_create(team=cast.alpha, name="restart").plaintext
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = [_sft_datum(types, tokenizer, p) for p in _prompts(random.Random(2), 4)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root, cache = serving.data_dir / "checkpoints", tiny_model_dir.parent

    def steps(trainer: Any, count: int, losses: list[float]) -> None:
        for _ in range(count):
            losses.append(_mean_loss(trainer.forward_backward(data, "cross_entropy").result(), data))
            trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()

    interrupted: list[float] = []
    with trainer_service(root, cache, token="t-restart", port=port) as first:
        worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=first.url,
                              TRAINER_SERVICE_TOKEN="t-restart", TINKER_POLL_S="5")  # fmt: skip
        client = tinker.ServiceClient(base_url=f"{gateway.url}/tinker", api_key=f"tml-{key}")
        ours = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=4).result()
        steps(ours, 2, interrupted)
        ours.save_state(name="early").result()
        steps(ours, 1, interrupted)
        interrupted.append(_mean_loss(ours.forward_backward(data, "cross_entropy").result(), data))
        first.process.kill()  # type: ignore[attr-defined]
        first.process.wait()  # type: ignore[attr-defined]
    with trainer_service(root, cache, token="t-restart", port=port):
        ours.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        steps(ours, 2, interrupted)
        whole: list[float] = []
        reference = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=4).result()
        steps(reference, 6, whole)
    print(f"losses, interrupted {[round(v, 4) for v in interrupted]} vs whole {[round(v, 4) for v in whole]}")
    assert interrupted == whole and whole[-1] < whole[0], (interrupted, whole)
    model = TinkerModel.objects.get(pk=ours.model_id)
    assert not model.lost
    [event] = RunEvent.objects.filter(run=model.run, message__contains="session was rebuilt")
    print(event.message)
    # From the state saved at step 2, with the one optimizer step and the pending gradient since.
    assert "from its checkpoint of step 2 by running 3 requests again (1 optimizer step)" in event.message
    assert "Traceback" not in worker.output()


def _followers_of(pid: int) -> list[int]:
    """Data-parallel follower processes (``python -m training.hosting.follower``) whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat, command = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"training.hosting.follower" in command:
            found.append(int(entry.name))
    return found


def test_a_training_client_on_two_devices_trains_as_one_and_outlives_a_lost_rank(
    gateway,  # noqa: F811  (the fixture imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
):
    """``user_metadata={"devices": "2"}``: the client's session in the trainer service is trained
    over 2 gloo ranks (the service's process and a follower it starts). Its losses are a 1-device
    client's within float32 summation noise, also after the follower is SIGKILLed between a
    ``forward_backward`` and its ``optim_step`` (restarted, the pending call replayed)."""
    import os
    import signal

    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from projects.models import TinkerModel

    register_base_model(tiny_model_dir)
    key = services.api_key_create(team=cast.alpha, name="ranks").plaintext
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = [_sft_datum(types, tokenizer, p) for p in _prompts(random.Random(5), 6)]
    root, cache = serving.data_dir / "checkpoints", tiny_model_dir.parent

    def train(trainer: Any, count: int, *, service: Any = None) -> list[float]:
        losses = []
        for step in range(count):
            losses.append(_mean_loss(trainer.forward_backward(data, "cross_entropy").result(), data))
            if service is not None and step == 2:
                [follower] = _followers_of(service.process.pid)
                os.kill(follower, signal.SIGKILL)
            trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        return losses

    with trainer_service(root, cache, token="t-ranks") as service:
        start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=service.url,
                     TRAINER_SERVICE_TOKEN="t-ranks", TINKER_POLL_S="5")  # fmt: skip
        client = tinker.ServiceClient(base_url=f"{gateway.url}/tinker", api_key=f"tml-{key}")
        ours = client.create_lora_training_client(
            base_model=BASE_MODEL, rank=8, seed=4, user_metadata={"devices": "2"}
        ).result()
        two = train(ours, 4, service=service)
        stats = service.stats()["data_parallel"]
        one = train(client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=4).result(), 4)
    print(f"losses on 2 devices {[round(v, 5) for v in two]} vs 1 {[round(v, 5) for v in one]}")
    assert two == pytest.approx(one, rel=1e-4) and one[-1] < one[0], (two, one)
    model = TinkerModel.objects.get(pk=ours.model_id)
    assert stats == {"tinker-" + model.pk.replace(":", "-"): {"devices": 2, "rank_restarts": 1}}, stats
    assert [m.metrics["update_devices"] for m in model.run.step_metrics.order_by("step")] == [2.0] * 4


def test_published_checkpoints_copies_prompt_logprobs_and_cancelled_samples_through_the_sdk(
    gateway,  # noqa: F811  (the fixture imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
):
    """The SDK's sample cancel, ``publish_checkpoint_from_tinker_path`` / ``unpublish_…``,
    ``copy_weights`` and ``compute_logprobs``, unchanged: a sample abandoned while queued never runs;
    another team loads a published state (the same weights, logprob for logprob) only while it is
    published; a copy is the copying team's, whole after the source is unpublished; a sampler's
    prompt logprobs are its learner's."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from projects.models import TinkerFuture, TinkerFutureStatus, TinkerModel

    register_base_model(tiny_model_dir)
    alpha_key = services.api_key_create(team=cast.alpha, name="alpha").plaintext
    beta_key = services.api_key_create(team=cast.beta, name="beta").plaintext
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = [_sft_datum(types, tokenizer, p) for p in _prompts(random.Random(5), 4)]
    url = f"{gateway.url}/tinker"

    def wait_for(check: Any, what: str) -> Any:
        deadline = time.monotonic() + 30
        while not (found := check()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)
        return found

    # No worker yet: the sample stays queued until its client gives up on it.
    beta = tinker.ServiceClient(base_url=url, api_key=f"tml-{beta_key}", project_id="tinker")
    sampler = beta.create_sampling_client(base_model=BASE_MODEL).result()
    abandoned = sampler.sample(prompt=types.ModelInput.from_ints(tokenizer.encode("abc:")), num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=4))  # fmt: skip
    queued = wait_for(
        lambda: TinkerFuture.objects.filter(team=cast.beta, kind="sample").first(), "the sample"
    )
    time.sleep(1.0)  # the SDK has the request's id and polls for it
    abandoned.future().cancel()
    wait_for(
        lambda: TinkerFuture.objects.get(pk=queued.pk).status == TinkerFutureStatus.CANCELLED, "the cancel"
    )

    def logprobs(client: Any) -> list[list[float]]:
        return [
            out["logprobs"].tolist() for out in client.forward(data, "cross_entropy").result().loss_fn_outputs
        ]

    with trainer_service(serving.data_dir / "checkpoints", tiny_model_dir.parent, token="t-share") as service:
        worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=service.url,
                              TRAINER_SERVICE_TOKEN="t-share", TINKER_POLL_S="5")  # fmt: skip
        alpha = tinker.ServiceClient(base_url=url, api_key=f"tml-{alpha_key}")
        trainer = alpha.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        path = trainer.save_state(name="shared").result().path
        expected = logprobs(trainer)
        with pytest.raises(tinker.NotFoundError):  # alpha's alone until published
            beta.create_training_client_from_state(path).result()
        alpha_rest = tinker.RestClient(base_url=url, api_key=f"tml-{alpha_key}")
        alpha_rest.publish_checkpoint_from_tinker_path(path).result()
        assert [c.public for c in alpha_rest.list_checkpoints(trainer.model_id).result().checkpoints] == [
            True
        ]
        theirs = beta.create_training_client_from_state(path).result()
        assert logprobs(theirs) == expected
        copy_path = beta.copy_weights(path).result()
        alpha_rest.unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            beta.create_training_client_from_state(path).result()
        from_copy = beta.create_training_client_from_state(copy_path).result()
        assert logprobs(from_copy) == expected
        copy = TinkerModel.objects.get(pk=copy_path.removeprefix("tinker://").rsplit("/", 2)[0])
        assert copy.session.team == cast.beta and copy.run.config["copied_from"] == path

        # Prompt logprobs (compute_logprobs: what the cookbook's KL penalty reads) are the learner's.
        tokens = tokenizer.encode("abcde: ok", add_special_tokens=False)
        full = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})  # fmt: skip
        learner = trainer.forward([full], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        sampling = trainer.save_weights_and_get_sampling_client().result()
        scored = sampling.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert scored[0] is None and scored[1:] == pytest.approx(learner, abs=1e-5)
        tail = sampling.compute_logprobs(
            types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=2
        ).result()
        assert tail[:-2] == [None] * (len(tokens) - 2) and tail[-2:] == pytest.approx(learner[-2:], abs=1e-5)
    assert TinkerFuture.objects.get(pk=queued.pk).status == TinkerFutureStatus.CANCELLED  # never ran
    assert "Traceback" not in worker.output()
