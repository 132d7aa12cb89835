"""``manage.py up`` splits the cores between the torch processes it starts (benchmarks/threads_split.py)."""

import pytest

from artweb.management.commands.up import torch_process_environment


@pytest.fixture
def no_thread_settings(monkeypatch):
    monkeypatch.delenv("TORCH_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


@pytest.mark.parametrize(
    ("cores", "processes", "threads"), [(2, 2, "1"), (16, 2, "8"), (2, 1, "2"), (1, 2, "1"), (7, 2, "3")]
)
def test_cores_are_split_between_the_torch_processes(no_thread_settings, cores, processes, threads):
    assert torch_process_environment(processes, cores=cores) == {
        "TORCH_THREADS": threads,
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def test_the_operators_settings_win(monkeypatch):
    monkeypatch.setenv("TORCH_THREADS", "4")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert torch_process_environment(2, cores=2) == {"TORCH_THREADS": "4", "OMP_WAIT_POLICY": "ACTIVE"}
