"""Just the facts: the model summarises short articles shipped in ``articles/``; RULER ranks each
group of summaries through an OpenAI-compatible judge (by default artweb's own gateway).

    .venv-art/bin/python examples/just_the_facts/main.py --steps 10 --base-url http://127.0.0.1:8000/v1 --api-key aw_... \\
        --judge-model openai/smollm2-135m-instruct

Training rewards are RULER's relative scores (``art.rewards.ruler_score_group``: the judge answers in
a JSON schema, which artweb serves with constrained decoding). A group the judge fails on (a weak
judge may run out of tokens mid-JSON) keeps the judge-free score below, marked ``judge_failed``,
rather than being dropped, so a step always has a group to train on. The held-out score before and after is judge-free, so the two
compare: the share of the article's facts (its numbers and capitalised names) that the summary
keeps, halved when the summary runs past 40 words.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  (first: it sets ART's environment)
from art.rewards import ruler_score_group  # noqa: E402
from common import art  # noqa: E402

ARTICLES = Path(__file__).with_name("articles")
SYSTEM = "Summarise the article in one or two sentences. Keep the key facts: who, what, where, numbers."
RUBRIC = """
- A summary that states the article's main facts (who, what, where, the key numbers) correctly scores high.
- A summary that invents facts, gets numbers wrong or talks about something else scores low.
- Shorter is better when two summaries keep the same facts.
"""


def facts(text: str) -> set[str]:
    """Numbers and capitalised words after a sentence's first word: a rough list of what matters."""
    numbers = set(re.findall(r"\d[\d,.]*\d|\d", text))
    names = {word for word in re.findall(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-z]+", text)}
    return numbers | names


def fact_score(article: str, summary: str) -> float:
    wanted = facts(article.split("\n", 1)[-1])
    kept = sum(fact in summary for fact in wanted) / max(len(wanted), 1)
    return kept / 2 if len(summary.split()) > 40 else kept


def make_rollout(max_tokens: int) -> common.Rollout:
    async def rollout(model: art.TrainableModel, article: str, temperature: float) -> art.Trajectory:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": article}]
        choice = await common.sample(model, messages, max_tokens=max_tokens, temperature=temperature)
        return art.Trajectory(
            messages_and_choices=[*messages, choice], reward=fact_score(article, choice.message.content or "")
        )

    return rollout


def main() -> None:
    flags = common.parser(__doc__.splitlines()[0], model="just-the-facts")
    flags.add_argument("--judge-model", default="openai/smollm2-135m-instruct",
                       help="a litellm model name; openai/<name> goes to --judge-base-url")  # fmt: skip
    flags.add_argument(
        "--judge-base-url", help="the judge's OpenAI-compatible endpoint (default: --base-url)"
    )
    flags.add_argument("--judge-api-key", help="its key (default: --api-key)")
    flags.add_argument("--judge-max-tokens", type=int, default=800)
    flags.set_defaults(max_tokens=48, group_size=3, groups=1, eval_rows=2)
    args = flags.parse_args()
    articles = [path.read_text().strip() for path in sorted(ARTICLES.glob("*.txt"))]
    held_out, training = articles[-args.eval_rows :], articles[: -args.eval_rows]
    judge: dict[str, Any] = {
        "api_base": args.judge_base_url or args.base_url,
        "api_key": args.judge_api_key or args.api_key,
        "max_tokens": args.judge_max_tokens,
        "temperature": 0.0,
    }

    async def score_group(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        scored = await ruler_score_group(
            group, args.judge_model, extra_litellm_params=judge, rubric=RUBRIC, swallow_exceptions=True
        )
        if scored is None:
            for trajectory in group.trajectories:
                trajectory.metrics["judge_failed"] = 1.0
        return scored or group

    def train_scenarios(step: int) -> list[str]:
        return [training[(step * args.groups + group) % len(training)] for group in range(args.groups)]

    asyncio.run(
        common.train(
            args,
            rollout=make_rollout(args.max_tokens),
            train_scenarios=train_scenarios,
            held_out=held_out,
            score_group=score_group,
        )
    )


if __name__ == "__main__":
    main()
