"""The demo run: a format task the bundled SmolLM2-135M-Instruct learns visibly on CPU.

The task rows are short factual questions; the reward is a regex grader that gives 1 when the
whole reply is at most eight words (the system prompt asks for "a few words"). The base model
rambles in about three replies of four, so GRPO groups have reward variance from step 1, and the
reward climbs within ten steps (the issue notes have a measured curve). Alternatives tried:
<answer>-tag format (never produced by the base model in 72 samples: no variance, nothing to learn)
and "contains the answer" (about 0.35 at step 1 but noisy and bounded by what a 135M model knows).
"""

from pathlib import Path

TASKS_PATH = Path(__file__).with_name("format_tasks.jsonl")

SYSTEM_PROMPT = "Answer the question in a few words."

REWARD_SPEC = {
    "type": "regex",
    "name": "at_most_8_words",
    "input": "{{sample.output_text}}",
    "pattern": r"^\W*(?:\S+\s+){0,7}\S+\W*$",
    "flags": ["DOTALL"],
}

RUN_CONFIG = {
    "groups_per_step": 4,
    "group_size": 6,
    "max_new_tokens": 16,
    "learning_rate": 2e-4,
    "temperature": 1.0,
}
