"""The demo run: a format task the bundled SmolLM2-135M-Instruct can learn on CPU in a few steps.

The reward is a regex grader: 1 when the reply wraps a short answer in <answer>…</answer>. The base
model follows that instruction only sometimes, so GRPO groups have reward variance to learn from.
"""

from pathlib import Path

TASKS_PATH = Path(__file__).with_name("format_tasks.jsonl")

SYSTEM_PROMPT = (
    "You answer questions. Put your final answer inside <answer></answer> tags, "
    "for example: <answer>Paris</answer>. Keep it short."
)

REWARD_SPEC = {
    "type": "regex",
    "name": "answer_tags",
    "input": "{{sample.output_text}}",
    "pattern": r"<answer>[^<]{1,40}</answer>",
    "flags": ["IGNORECASE"],
}

RUN_CONFIG = {
    "groups_per_step": 4,
    "group_size": 6,
    "max_new_tokens": 24,
    "learning_rate": 2e-4,
    "temperature": 1.0,
}
