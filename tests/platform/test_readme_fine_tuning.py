"""README "Fine-tune through OpenAI's fine-tuning API" states the reinforcement recipe a job trains
with (projects.services.fine_tuning.RECIPES, from the demo's RUN_CONFIG): it said 6 completions per
prompt where the jobs used 8."""

from __future__ import annotations

import re
from pathlib import Path

from projects.defaults import RUN_CONFIG

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_states_the_reinforcement_jobs_recipe():
    section = (
        README.read_text().split("## Fine-tune through OpenAI's fine-tuning API", 1)[1].split("\n## ", 1)[0]
    )
    text = " ".join(section.split())
    completions = re.search(r"(\d+) completions per prompt", text)
    assert completions is not None and int(completions.group(1)) == RUN_CONFIG["group_size"], completions
    assert f"cosine from a {RUN_CONFIG['learning_rate']:.0e} peak".replace("e-0", "e-") in text
    assert f"warm-up {RUN_CONFIG['warmup_steps']}" in text
    assert {1: "one pass", 2: "two passes"}[RUN_CONFIG["ppo_epochs"]] + " per batch" in text
    assert "validation_fraction" not in text  # the API takes a validation_file
