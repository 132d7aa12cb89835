"""The environments' CPU proof script still runs end to end (on the tiny model, one step)."""

import json

import pytest

from benchmarks import env_proof


@pytest.mark.parametrize("task", ["tools", "tic_tac_toe"])
def test_env_proof_trains_and_validates_on_a_tiny_model(task, tiny_model_dir, tmp_path):
    report_path = tmp_path / "report.json"
    report = env_proof.main(
        [
            "--task", task,
            "--model", str(tiny_model_dir),
            "--cache-dir", str(tmp_path / "cache"),
            "--steps", "1",
            "--groups-per-step", "1",
            "--group-size", "2",
            "--val-samples", "1",
            "--json", str(report_path),
        ]
    )  # fmt: skip
    assert [row["step"] for row in report["curve"]] == [1]
    assert report["step_0"]["n"] == report["final"]["n"] == len(env_proof.task_settings(task)["validation"])
    assert json.loads(report_path.read_text())["final"]["reward_mean"] == report["final"]["reward_mean"]
