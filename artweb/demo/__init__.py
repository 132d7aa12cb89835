"""The demo run: short factual questions for the bundled SmolLM2-135M-Instruct on CPU.

The reward is a `multi` grader: half for a reply of at most eight words (the system prompt asks
for "a few words"), half for containing the expected answer. Why both: brevity alone climbs fast
(0.25 to 0.96 in 20 steps, measured) but the model learns to emit short gibberish, the textbook
reward hack; correctness alone is noisy and bounded by what a 135M model knows. Together the
reward still climbs (the issue notes have the measured curves) and the answers stay answers.
An <answer>-tag format task was tried first: the base model never produced the tags in 72 samples,
so every group had zero variance and there was nothing to learn.
"""

from pathlib import Path

TASKS_PATH = Path(__file__).with_name("format_tasks.jsonl")

SYSTEM_PROMPT = "Answer the question in a few words."

REWARD_SPEC = {
    "type": "multi",
    "name": "brief_and_correct",
    "graders": {
        "brief": {
            "type": "regex",
            "input": "{{sample.output_text}}",
            "pattern": r"^\W*(?:\S+\s+){0,7}\S+\W*$",
            "flags": ["DOTALL"],
        },
        "correct": {
            "type": "string_check",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "ilike",
        },
    },
    "calculate_output": "0.5 * brief + 0.5 * correct",
}

RUN_CONFIG = {
    "groups_per_step": 4,
    "group_size": 6,
    "max_new_tokens": 16,
    "learning_rate": 2e-4,
    "temperature": 1.0,
}
