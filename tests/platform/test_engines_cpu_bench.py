"""The pure parts of benchmarks/engines_cpu.py (process-tree memory, logprob comparison, the
tables); the benchmark itself starts vLLM and is run by hand, not here."""

from __future__ import annotations

import math
import os

import pytest
import torch

from benchmarks import engines_cpu


def fake_process(proc, pid: int, parent: int, comm: str, rss_kib: int, pss_kib: int | None = None) -> None:
    folder = proc / str(pid)
    folder.mkdir()
    # A command name with a space and a parenthesis, as /proc allows: fields after the last ')'.
    (folder / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1 4194560\n")
    (folder / "status").write_text(f"Name:\t{comm}\nVmPeak:\t 99999 kB\nVmRSS:\t {rss_kib} kB\n")
    if pss_kib is not None:
        (folder / "smaps_rollup").write_text(f"Rss:\t {rss_kib} kB\nPss:\t {pss_kib} kB\n")


def test_tree_memory_sums_a_process_and_all_its_descendants_only(tmp_path):
    fake_process(tmp_path, 10, 1, "vllm api", 1000, 600)
    fake_process(tmp_path, 11, 10, "EngineCore) x", 3000, 2500)
    fake_process(tmp_path, 12, 11, "worker", 500)  # no smaps_rollup: its PSS counts 0
    fake_process(tmp_path, 20, 1, "someone else", 7000, 7000)
    (tmp_path / "self").mkdir()  # not a pid

    assert sorted(engines_cpu.tree_pids(10, engines_cpu.read_parents(tmp_path))) == [10, 11, 12]
    assert engines_cpu.tree_memory_kib(10, tmp_path) == {"rss": 4500, "pss": 3100}


def test_tree_memory_of_this_process_is_its_own_rss_at_least():
    memory = engines_cpu.tree_memory_kib(os.getpid())
    assert memory["rss"] > 10_000  # KiB: a Python with torch loaded


def test_logprob_difference_reports_max_and_mean_absolute_gap():
    found = engines_cpu.logprob_difference([-1.0, -2.5, -0.25], [-1.5, -2.0, -0.25])
    assert found == {"max": 0.5, "mean": pytest.approx(1 / 3), "tokens": 3}
    with pytest.raises(ValueError):
        engines_cpu.logprob_difference([-1.0], [-1.0, -2.0])


def test_tempered_logprobs_are_the_log_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]])
    plain = engines_cpu.tempered_logprobs(logits, [0, 2], temperature=1.0)
    assert plain[0] == pytest.approx(2 - math.log(math.exp(2) + 2))
    hot = engines_cpu.tempered_logprobs(logits, [0, 2], temperature=2.0)
    assert hot[1] == pytest.approx(1.5 - math.log(1 + math.exp(0.5) + math.exp(1.5)))


def test_vllm_token_ids_come_from_token_ids_or_token_strings():
    assert engines_cpu.vllm_token_ids({"token_ids": [5, 7]}) == [5, 7]
    choice = {"logprobs": {"tokens": ["token_id:506", "token_id:30"]}}
    assert engines_cpu.vllm_token_ids(choice) == [506, 30]


def row(engine: str, clients: int, tokens_per_s: float, **extra) -> dict:
    return {"engine": engine, "dtype": "fp32", "adapter": "none", "load": "alone", "clients": clients,
            "tokens_per_s": tokens_per_s, "ttft_s": 0.1 if engine == "artweb" else 0.2,
            "start_s": 4.0 if engine == "artweb" else 20.0, "rss_gib": 1.0, **extra}  # fmt: skip


def test_ratios_pair_rows_of_the_same_setting_and_divide_vllm_by_artweb():
    rows = [row("artweb", 1, 40.0), row("artweb", 16, 400.0), row("vllm", 1, 30.0), row("vllm", 16, 200.0),
            row("vllm", 4, 100.0)]  # fmt: skip
    ratios = engines_cpu.ratio_rows(rows)
    assert [(r["clients"], r["tokens_per_s"]) for r in ratios] == [(1, 0.75), (16, 0.5)]
    assert ratios[0]["ttft"] == pytest.approx(2.0) and ratios[1]["ttft"] is None  # 1 client only
    assert ratios[0]["start"] == pytest.approx(5.0)


def test_results_table_has_one_line_per_row_and_ttft_on_the_one_client_row():
    rows = [row("artweb", 1, 40.0, logprob_diff={"max": 0.01, "mean": 0.001, "tokens": 8}),
            row("artweb", 16, 400.0)]  # fmt: skip
    lines = engines_cpu.results_table(rows).splitlines()
    assert lines[0].startswith("| engine | dtype |") and len(lines) == 4
    assert "| 40.0 | 100 | 4.0 | 1.00 | 0.0100 / 0.00100 |" in lines[2]
    assert lines[3].endswith("| 400.0 |  | 4.0 | 1.00 |  |")
    ratios = engines_cpu.ratios_table(engines_cpu.ratio_rows(rows))
    assert len(ratios.splitlines()) == 2  # no vLLM rows: the header alone
