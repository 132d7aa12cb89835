"""The CPU benchmark script still runs against the training core (on a tiny model, without TRL)."""

import json


def test_grpo_benchmark_runs_on_a_tiny_model_and_reports_ratios(tiny_model_dir, tmp_path, capsys):
    from benchmarks import grpo_cpu

    report_path = tmp_path / "report.json"
    report = grpo_cpu.main(
        [
            "--model", str(tiny_model_dir),
            "--cache-dir", str(tmp_path),
            "--skip-trl",
            "--steps", "1",
            "--groups-per-step", "1",
            "--group-size", "2",
            "--max-new-tokens", "4",
            "--eval-samples", "1",
            "--throughput-repeats", "1",
            "--json", str(report_path),
        ]
    )  # fmt: skip

    assert len(report["ours"]["step_seconds"]) == 1
    assert report["throughput"]["engine_group"]["tokens"] > 0
    assert report["throughput_ratio"] > 0
    assert json.loads(report_path.read_text())["ours"]["eval_reward"] is not None
    assert "== ratios" in capsys.readouterr().out


def test_outbound_benchmark_runs_and_reports_the_added_latency(tmp_path, capsys):
    from benchmarks import bench_outbound

    report = bench_outbound.main(["--requests", "5", "--json", str(tmp_path / "outbound.json")])
    assert (
        report["added"]["median_us"]
        == json.loads((tmp_path / "outbound.json").read_text())["added"]["median_us"]
    )
    assert set(report["checks"]) == {
        "check_url, no lookup",
        "check_url with lookup",
        "refused: http://2130706433/",
    }
    assert "request pairs" in capsys.readouterr().out


def test_grammar_benchmark_runs_on_a_tiny_model_and_reports_ratios(tiny_model_dir, tmp_path, capsys):
    from benchmarks import bench_grammar

    report = bench_grammar.main(
        ["--model", str(tiny_model_dir), "--batch", "2", "--max-new-tokens", "6", "--repeats", "1",
         "--json", str(tmp_path / "grammar.json")]
    )  # fmt: skip
    assert report["unconstrained"]["ratio"] == 1.0 and report["json_schema"]["ratio"] > 0
    assert report["mask_alone_us_per_token"]["json_schema"] > 0
    assert json.loads((tmp_path / "grammar.json").read_text())["json_object"]["steps_per_run"] >= 1
    assert "ms per decoding step" in capsys.readouterr().out


def test_resident_jobs_benchmark_runs_its_three_sides_on_a_tiny_model(tmp_path, capsys):
    from benchmarks import resident_jobs

    summary = resident_jobs.main(["--tiny", "--jobs", "2", "--cache", str(tmp_path)])
    assert set(summary) == {"from disk", "kept", "service"}
    assert (
        summary["service"]["load"] < summary["from disk"]["load"]
        or summary["kept"]["load"] < summary["from disk"]["load"]
    )
    assert "/ from disk" in capsys.readouterr().out


def test_session_capacity_benchmark_counts_sessions_on_one_base(tmp_path, capsys):
    from benchmarks import session_capacity

    report = session_capacity.main(["--tiny", "--sessions", "3", "--cache", str(tmp_path), "--memory-gib", "4",
                                    "--headroom-gib", "1"])  # fmt: skip
    assert (
        report["per_session_mib"] > 0 and report["sessions_on_one_base"] >= report["sessions_with_own_base"]
    )
    assert "sessions on one base" in capsys.readouterr().out


def test_sample_efficiency_bold_task_pays_for_bold_and_for_the_answer_separately():
    from benchmarks.sample_efficiency import task
    from training.rewards import Sample, build_grader, grade_many

    settings = task("bold")
    item = {"answer": "Paris", "accept": "Paris"}
    replies = ["The capital of France is **Paris**.", "**Berlin**", "Paris.", "**Paris", "**\nParis**"]
    results = grade_many(
        build_grader(settings["reward"]), [Sample(output_text=r) for r in replies], [item] * 5
    )
    assert [r.reward for r in results] == [1.0, 0.5, 0.5, 0.5, 0.5]
    assert "**word**" in settings["system_prompt"] and settings["train"] and settings["validation"]


def test_sample_efficiency_benchmark_runs_a_task_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    from benchmarks import sample_efficiency

    report = sample_efficiency.main(
        ["--model", str(tiny_model_dir), "--cache-dir", str(tmp_path), "--skip-trl", "--tasks", "bold",
         "--configs", "new_defaults", "--steps", "1", "--groups-per-step", "1", "--group-size", "2",
         "--json", str(tmp_path / "se.json")]
    )  # fmt: skip
    outcome = report["tasks"]["bold"]["new_defaults"]
    assert sorted(outcome["held_out"]) == [0, 1] and outcome["rollouts"] == 2
    assert set(outcome["held_out_graders"][1]) == {"bold", "correct"}
    assert (
        json.loads((tmp_path / "se.json").read_text())["tasks"]["bold"]["new_defaults"]["steps_to_trl"]
        is None
    )
    assert "bold: held-out reward" in capsys.readouterr().out


def test_trainer_fairness_benchmark_runs_its_three_sides_on_a_tiny_model(tmp_path, capsys):
    from benchmarks import trainer_fairness

    report = trainer_fairness.main(["--tiny", "--cache", str(tmp_path), "--samples", "2", "--max-tokens", "16",
                                    "--prompt-tokens", "8", "--repeats", "2"])  # fmt: skip
    assert all(report[f"{side}_median_s"] > 0 for side in ("alone", "before", "after"))
    assert report["before_median_ratio"] > 0 and report["after_median_ratio"] > 0
    assert "lock per slice" in capsys.readouterr().out


def test_endpoint_grader_benchmark_grades_a_step_against_its_loopback_endpoint(tmp_path, capsys):
    from benchmarks import endpoint_grader

    report = endpoint_grader.main(["--steps", "1", "--latency-ms", "0", "--json", str(tmp_path / "e.json")])
    assert report == json.loads((tmp_path / "e.json").read_text())
    assert report["rollouts_per_step"] == 16 and len(report["sides"]) == 3
    assert "concurrent endpoint vs this" in capsys.readouterr().out
