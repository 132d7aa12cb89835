"""README "Fine-tune through OpenAI's fine-tuning API" states the reinforcement recipe a job trains
with (projects.services.fine_tuning.RECIPES, from the demo's RUN_CONFIG): it said 6 completions per
prompt where the jobs used 8."""

from __future__ import annotations

import ast
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


def _example_job_call() -> ast.Call:
    """The ``client.fine_tuning.jobs.create(...)`` call of the section's first Python block."""
    section = README.read_text().split("## Fine-tune through OpenAI's fine-tuning API", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    calls = [node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)]
    return next(call for call in calls if ast.unparse(call.func) == "client.fine_tuning.jobs.create")


def test_the_readme_example_runs_on_shipped_files_with_a_grader_the_bundled_model_can_move():
    """Issue 54: the example named a `train.jsonl` nobody had, and an exact-match grader that paid
    every sentence of the bundled model 0 (a job that "succeeded" having learnt nothing). Now it
    uploads examples/fine_tuning/'s files (the arithmetic task benchmarks/fine_tuning_job.py
    measures), and its grader pays the right number in a sentence half, the number alone in full."""
    from benchmarks.fine_tuning_job import openai_rows
    from benchmarks.sample_efficiency import ARITHMETIC_PROMPT, ARITHMETIC_REWARD, arithmetic_rows
    from projects.services.fine_tuning import task_row
    from projects.services.rewards import grader_problems
    from training.rewards import Sample, build_grader, grade_many

    call = _example_job_call()
    code = README.read_text()
    for name in ("train", "valid"):
        assert f'open("examples/fine_tuning/{name}.jsonl", "rb")' in code
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    assert {"training_file", "validation_file"} <= set(keywords), "the example holds rows out"
    method = ast.literal_eval(keywords["method"])
    grader = method["reinforcement"]["grader"]
    assert grader == ARITHMETIC_REWARD  # the grader the measured figure was taken with

    # The files are the benchmark's rows, each one a valid reinforcement row of the API.
    train, valid = openai_rows()
    expected = [
        {"messages": [{"role": "system", "content": ARITHMETIC_PROMPT}, {"role": "user", "content": row["prompt"]}],
         **row["item"], "split": row["split"]}
        for row in arithmetic_rows()
    ]  # fmt: skip
    assert [{**line, "split": "train"} for line in train] + [
        {**line, "split": "validation"} for line in valid
    ] == [
        *(line for line in expected if line["split"] == "train"),
        *(line for line in expected if line["split"] == "validation"),
    ]
    assert (len(train), len(valid)) == (48, 16)
    assert all(task_row(line)["item"] == {"answer": line["answer"]} for line in train + valid)

    # Partial credit is what lets a model that answers in sentences learn from the first step.
    built = build_grader(grader_problems(grader, field="grader"))
    item = {"answer": train[0]["answer"]}
    answer = item["answer"]
    replies = [f"{answer}", f"The answer is {answer}.", f"{int(answer) + 1}", f"It is {int(answer) + 1}."]
    rewards = [
        result.reward for result in grade_many(built, [Sample(output_text=r) for r in replies], [item] * 4)
    ]
    assert rewards == [1.0, 0.5, 0.0, 0.0]
