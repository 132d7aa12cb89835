"""The demo run: short factual questions the bundled SmolLM2-135M-Instruct can learn on CPU.

The reward is a string_check grader: 1 when the reply contains the expected answer (case
insensitive). The base model (fp32, dequantised from Q4_1) gets about a third right at temperature
1, so GRPO groups have reward variance to learn from. (A tag-format task was tried first: the base
model never produced the tags in 72 samples, so every group had zero variance and nothing to learn.)
"""

from pathlib import Path

TASKS_PATH = Path(__file__).with_name("format_tasks.jsonl")

SYSTEM_PROMPT = "Answer the question in a few words."

REWARD_SPEC = {
    "type": "string_check",
    "name": "contains_answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}

RUN_CONFIG = {
    "groups_per_step": 4,
    "group_size": 6,
    "max_new_tokens": 16,
    "learning_rate": 2e-4,
    "temperature": 1.0,
}
