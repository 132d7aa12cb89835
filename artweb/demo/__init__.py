"""The demo run: short factual questions for the bundled SmolLM2-135M-Instruct on CPU.

The reward is a `multi` grader, `correct * (0.5 + 0.5 * brief)`: a reply earns nothing unless it
contains the expected answer, and full marks when it is also at most eight words (the system
prompt asks for "a few words"). Measured on 2 CPU cores, 20 steps of 4 questions x 6 samples:
mean reward 0.24 over steps 1-4, 0.43 over steps 16-20, and the replies stay answers ("A puppy!").
What did not work: brevity alone climbed fastest (0.25 to 0.96) but the model learned to emit
short gibberish, the textbook reward hack, and `0.5 * brief + 0.5 * correct` was hacked the same
way (gibberish still earned 0.5). An <answer>-tag format task gave no signal at all: the base model
never produced the tags in 72 samples, so every group had zero variance.
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
    "calculate_output": "correct * (0.5 + 0.5 * brief)",
}

RUN_CONFIG = {
    "groups_per_step": 4,
    "group_size": 6,
    "max_new_tokens": 16,
    "learning_rate": 2e-4,
    "temperature": 1.0,
}
