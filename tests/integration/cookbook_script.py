#!/usr/bin/env python
"""Run one supervised and one RL recipe of tinker-cookbook 0.6.1, unchanged, against artweb.

The cookbook's own training loops do the work:

* SL: ``tinker_cookbook.supervised.train.main(Config)`` with the cookbook's
  ``FromConversationFileBuilder`` over a JSONL file of a handful of conversations written here.
* RL: ``tinker_cookbook.rl.train.main(Config)`` (sync on-policy loop) with either a tiny
  "say the word" env defined here (graded reward, so groups have non-zero advantages even with a
  random-init model) or the cookbook's own arithmetic env
  (``tinker_cookbook.recipes.math_rl.arithmetic_env.ArithmeticDatasetBuilder``).

Nothing in the cookbook is edited. Offline substitutions, all from the outside:

* tokenizer: ``tokenizer_utils.register_tokenizer(<artweb base model name>, factory)`` so every
  ``get_tokenizer(model_name)`` in the loops and builders returns the local tokenizer folder;
* renderer: ``role_colon`` (works with any tokenizer; string stop ``"\\n\\nUser:"``) or
  ``qwen3_instruct`` (ChatML, matches artweb's tiny tokenizer; stop token id ``<|im_end|>``);
* pricing: the loops fetch https://tinker-docs.thinkingmachines.ai/tinker/models.json once
  (5 s timeout, failure only logs a warning); we mark it fetched so nothing is attempted;
* API key: the loops build ``tinker.ServiceClient(base_url=config.base_url)`` with no api_key, so
  the key goes in ``TINKER_API_KEY``; no wandb (wandb_project=None), no HF hub, no HF datasets.

Prompt logprobs (``compute_logprobs``) are offered, so RL runs with ``kl_penalty_coef`` against
the base model and ``compute_post_kl``, and SL holds out a test split (``SamplerNLLEvaluator``).
Features left off because artweb does not offer them: ``loss_fn="stable_reinforce"`` / async RL
(needs ``record_stability_info``), ``rolling_save_every`` (deletes checkpoints by tinker path).

Usage (in a venv with tinker==0.38.0 and tinker-cookbook==0.6.1 installed --no-deps, see report):
    python sl_and_rl.py --base-url http://127.0.0.1:8000 --api-key <artweb key> \\
        --base-model <artweb base model name> --tokenizer /path/to/tokenizer_dir --log-dir /tmp/cb-run
Add --dry-run to build the tokenizer, datasets, envs and configs without contacting a server.
Prints ``RESULT {...}`` as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path

# No hub traffic from transformers / datasets / huggingface_hub, whatever happens.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import chz  # noqa: E402
import tinker  # noqa: E402
from tinker_cookbook import renderers, tokenizer_utils  # noqa: E402
from tinker_cookbook.completers import StopCondition  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import (  # noqa: E402
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.utils import cost_estimation  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": "blue"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "apple"}],
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}],
    [{"role": "user", "content": "Opposite of up?"}, {"role": "assistant", "content": "down"}],
    [{"role": "user", "content": "Say goodbye."}, {"role": "assistant", "content": "goodbye"}],
    [{"role": "user", "content": "Name an animal."}, {"role": "assistant", "content": "cat"}],
]


# ----------------------------------------------------------------------------- offline substitutes
def install_local_tokenizer(base_model: str, tokenizer_dir: str):
    """Make ``get_tokenizer(base_model)`` return the tokenizer in ``tokenizer_dir`` (no hub)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer_utils.register_tokenizer(base_model, lambda: tokenizer)
    return tokenizer


def skip_pricing_download() -> None:
    """The loops call ``fetch_model_pricing(model_name)``, which downloads the public price list
    once per process (5 s timeout, a failure only logs a warning). Mark it as already tried, so an
    offline run neither waits nor warns; the ``cost/`` metrics are then simply absent."""
    if hasattr(cost_estimation, "_pricing_fetched"):
        cost_estimation._pricing_fetched = True


# ----------------------------------------------------------------------------- the RL env
class SayWordEnv(Env):
    """Single turn: the user asks for ``word``; reward 1 for saying it, plus a graded part (the
    share of the reply's characters that occur in ``word``, times 0.5) so that samples of a
    random-init model still differ and the group advantages are not all zero."""

    def __init__(self, renderer: renderers.Renderer, word: str):
        self.renderer = renderer
        self.word = word

    @property
    def stop_condition(self) -> StopCondition:
        return self.renderer.get_stop_sequences()

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        convo = [{"role": "user", "content": f"Say {self.word}."}]
        return self.renderer.build_generation_prompt(convo), self.stop_condition

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        message, _termination = self.renderer.parse_response(action)
        text = renderers.get_text_content(message).strip().lower()
        said = float(self.word in text)
        overlap = sum(ch in self.word for ch in text) / max(1, len(text))
        return StepResult(
            reward=said + 0.5 * overlap,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.stop_condition,
            metrics={"said_word": said, "char_overlap": overlap},
        )


class SayWordDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batch_size: int, group_size: int,
                 n_batches: int, word: str):  # fmt: skip
        self.renderer, self.batch_size, self.group_size = renderer, batch_size, group_size
        self.n_batches, self.word = n_batches, word

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [
            ProblemGroupBuilder(
                env_thunk=partial(SayWordEnv, self.renderer, self.word),  # type: ignore[arg-type]
                num_envs=self.group_size,
                dataset_name="say_word",
            )
            for _ in range(self.batch_size)
        ]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class SayWordDatasetBuilder(RLDatasetBuilder):
    model_name_for_tokenizer: str
    renderer_name: str
    batch_size: int
    group_size: int
    n_batches: int
    word: str = "yes"

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer)
        return SayWordDataset(renderer, self.batch_size, self.group_size, self.n_batches, self.word), None


# ----------------------------------------------------------------------------- configs
def sl_config(args: argparse.Namespace, log_path: Path, base_url: str) -> sl_train.Config:
    data_file = log_path.parent / "sl_conversations.jsonl"
    data_file.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.base_model,  # resolved by the registered tokenizer
        renderer_name=args.renderer,
        max_length=64,
        batch_size=args.sl_batch_size,
        train_on_what=renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    return sl_train.Config(
        log_path=str(log_path),
        model_name=args.base_model,
        recipe_name="artweb_cookbook_sl_smoke",
        renderer_name=args.renderer,
        dataset_builder=FromConversationFileBuilder(
            common_config=common, file_path=str(data_file), test_size=2
        ),
        learning_rate=args.learning_rate,
        lr_schedule="constant",
        num_epochs=1,
        lora_rank=args.lora_rank,
        base_url=base_url,
        save_every=0,  # only the final checkpoint (save_state + save_weights_for_sampler "final")
        eval_every=2,  # the held-out split's NLL (compute_logprobs) at steps 0 and 2
        infrequent_eval_every=0,
        max_steps=args.sl_steps,
    )


def rl_config(args: argparse.Namespace, log_path: Path, base_url: str) -> rl_train.Config:
    if args.rl_env == "arithmetic":
        # The cookbook's own toy env (x + y with a few-shot prefix); with a random-init model the
        # reward is the same for every sample (-0.1: no stop sequence), so the advantages are 0.
        from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder

        builder: RLDatasetBuilder = ArithmeticDatasetBuilder(
            batch_size=args.rl_groups, model_name_for_tokenizer=args.base_model,
            renderer_name=args.renderer, n_batches=args.rl_steps, group_size=args.rl_group_size,
        )  # fmt: skip
    else:
        builder = SayWordDatasetBuilder(
            model_name_for_tokenizer=args.base_model, renderer_name=args.renderer,
            batch_size=args.rl_groups, group_size=args.rl_group_size, n_batches=args.rl_steps,
        )  # fmt: skip
    return rl_train.Config(
        learning_rate=args.learning_rate,
        dataset_builder=builder,
        model_name=args.base_model,
        recipe_name="artweb_cookbook_rl_smoke",
        max_tokens=args.max_tokens,
        log_path=str(log_path),
        renderer_name=args.renderer,
        eval_every=0,
        save_every=0,
        lora_rank=args.lora_rank,
        loss_fn=args.rl_loss,
        base_url=base_url,
        max_steps=args.rl_steps,
        num_groups_to_log=1,
        # A KL penalty against the base model and the KL between the policies before and after
        # each update: both score sequences with a sampler's compute_logprobs.
        kl_penalty_coef=0.01,
        kl_reference_config=rl_train.KLReferenceConfig(base_model=args.base_model),
        compute_post_kl=True,
        # left at their defaults on purpose (artweb lacks what they need): async_config=None,
        # stream_minibatch_config=None, rolling_save_every=0
    )


# ----------------------------------------------------------------------------- results
KEEP = ("train_mean_nll", "train_mean_bpb", "learning_rate", "num_tokens", "reward/total",
        "said_word", "char_overlap", "correct", "format", "kl_sample_train", "by_group/frac_mixed",
        "entropy", "loss", "test/nll", "kl_policy_base", "kl_pre_post")  # fmt: skip


def read_metrics(log_path: Path) -> list[dict]:
    path = log_path / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {
            k: v
            for k, v in row.items()
            if k == "step" or (not k.startswith("time/") and any(s in k for s in KEEP))
        }
        for row in rows
        if any(s in k for k in row for s in ("train_mean_nll", "reward/total", "test/nll"))
    ]


def checkpoints(log_path: Path) -> list[dict]:
    path = log_path / "checkpoints.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def download_weights(base_url: str, log_dir: Path, saved: list[dict]) -> dict:
    """``tinker_cookbook.weights.download`` of the SL loop's final training state (the cookbook
    exports it encrypted to a key made for the download, decrypts, deletes the export), and of an
    unencrypted export saved by name from a training client loaded from that state."""
    from tinker_cookbook import weights

    state = next(c["state_path"] for c in saved if c.get("name") == "final")
    training_dir = log_dir / "download-training"
    weights.download(tinker_path=state, output_dir=str(training_dir), base_url=base_url)
    service = tinker.ServiceClient(base_url=base_url)
    client = service.create_training_client_from_state(state).result()
    export = client.save_weights_external("plain", ttl_seconds=7200).result().path
    external_dir = log_dir / "download-external"
    weights.download(tinker_path=export, output_dir=str(external_dir), base_url=base_url)
    listed = tinker.RestClient(base_url=base_url).list_checkpoints(client.model_id).result()
    service.close("success").result()
    return {"state": state, "export": export, "training_dir": str(training_dir), "external_dir": str(external_dir),
            "training_files": sorted(p.name for p in training_dir.iterdir() if not p.name.startswith(".")),
            "external_files": sorted(p.name for p in external_dir.iterdir() if not p.name.startswith(".")),
            "listed": [(c.checkpoint_id, c.checkpoint_type, str(c.expires_at)) for c in listed.checkpoints]}  # fmt: skip


async def dry_run(sl: sl_train.Config, rl: rl_train.Config, tokenizer) -> dict:
    """Everything up to the first server call: datasets, a batch, env observations, parsing."""
    train_ds, test_ds = sl.dataset_builder()
    batch = train_ds.get_batch(0)
    rl_ds, _ = await rl.dataset_builder()
    builders = rl_ds.get_batch(0)
    envs = await builders[0].make_envs()
    ob, stop = await envs[0].initial_observation()
    fake = tokenizer.encode(" yes\n\nUser:", add_special_tokens=False)
    result = await envs[0].step(fake)
    return {
        "sl_batches": len(train_ds), "sl_test": test_ds is not None, "sl_batch_size": len(batch),
        "sl_datum_tokens": batch[0].model_input.length,
        "sl_loss_fn_inputs": sorted(batch[0].loss_fn_inputs),
        "rl_batches": len(rl_ds), "rl_groups": len(builders), "rl_group_size": len(envs),
        "rl_prompt": tokenizer.decode(ob.to_ints()), "rl_stop": stop,
        "rl_reward_for_fake_yes": result.reward,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--base-url", required=True, help="artweb root, e.g. http://127.0.0.1:8000 (/tinker is added)"
    )
    p.add_argument("--api-key", required=True, help="artweb API key (tml- is added if missing)")
    p.add_argument("--base-model", required=True, help="artweb base model name (catalogue name)")
    p.add_argument("--tokenizer", required=True, help="local tokenizer folder of that base model")
    p.add_argument("--log-dir", required=True)
    p.add_argument(
        "--renderer", default="role_colon", help="role_colon (any tokenizer) or qwen3_instruct (ChatML)"
    )
    p.add_argument("--sl-steps", type=int, default=3)
    p.add_argument("--sl-batch-size", type=int, default=2)
    p.add_argument("--rl-steps", type=int, default=2)
    p.add_argument("--rl-groups", type=int, default=2, help="env groups per RL step")
    p.add_argument("--rl-group-size", type=int, default=4, help="samples per group")
    p.add_argument("--rl-env", choices=["say_word", "arithmetic"], default="say_word")
    p.add_argument(
        "--rl-loss", default="importance_sampling", choices=["importance_sampling", "ppo", "cispo", "dro"]
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--only", choices=["sl", "rl"], default=None)
    p.add_argument("--dry-run", action="store_true", help="build everything, contact no server")
    p.add_argument(
        "--download", action="store_true", help="after SL: download its final weights (weights.download)"
    )
    args = p.parse_args()

    base_url = args.base_url.rstrip("/")
    if not base_url.endswith("/tinker"):
        base_url += "/tinker"
    key = args.api_key if args.api_key.startswith("tml-") else "tml-" + args.api_key
    os.environ["TINKER_API_KEY"] = key  # the cookbook's ServiceClient(...) takes no api_key

    log_dir = Path(args.log_dir).expanduser().resolve()
    sl_dir, rl_dir = log_dir / "sl", log_dir / "rl"
    for d in (sl_dir, rl_dir):
        # A leftover checkpoints.jsonl would make the loops *resume* (load_state with optimizer).
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)

    skip_pricing_download()
    tokenizer = install_local_tokenizer(args.base_model, args.tokenizer)
    sl = sl_config(args, sl_dir, base_url)
    rl = rl_config(args, rl_dir, base_url)

    result: dict = {"base_url": base_url, "base_model": args.base_model, "renderer": args.renderer,
                    "rl_env": args.rl_env, "rl_loss": args.rl_loss}  # fmt: skip
    if args.dry_run:
        result["dry_run"] = asyncio.run(dry_run(sl, rl, tokenizer))
        print("RESULT " + json.dumps(result, default=str))
        return 0

    ok = True
    for name, cfg, fn in (("sl", sl, sl_train.main), ("rl", rl, rl_train.main)):
        if args.only and name != args.only:
            continue
        start = time.monotonic()
        try:
            asyncio.run(fn(cfg))
            result[name] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 (report it and go on to the other recipe)
            ok = False
            traceback.print_exc()
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        log_path = Path(cfg.log_path)
        saved = checkpoints(log_path)
        result[name].update(seconds=round(time.monotonic() - start, 1), steps=read_metrics(log_path),
                            checkpoints=saved,
                            # The loop's last act is `with ServiceClient(...)` exiting, which POSTs
                            # /api/v1/sessions/{id}/finish: an error there comes after training.
                            reached_final_checkpoint=any(c.get("name") == "final" for c in saved))  # fmt: skip
        if name == "sl" and result[name]["ok"] and args.download:
            try:
                result["download"] = download_weights(base_url, log_dir, saved)
            except Exception as exc:  # noqa: BLE001
                ok = False
                traceback.print_exc()
                result["download"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    print("RESULT " + json.dumps(result, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
