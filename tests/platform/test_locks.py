"""The lock files pin one resolved stack per target and everything installs from them.

requirements/cpu.lock: pyproject's core + dev extra, torch as this machine's CPU build (what
`make install`, CI and the CPU image install). requirements/gpu.lock: core + gpu + dev for a
linux x86_64 / Python 3.11 GPU worker (vLLM, its torch, unsloth). Both come from `make lock`.
The slow tests resolve each lock against the package index with pip, as an install would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {"cpu": ("dev",), "gpu": ("gpu", "dev")}  # lock -> the extras it was compiled with
# The target both locks are resolved for (Makefile UV_COMPILE).
TARGET_ENVIRONMENT = {
    **default_environment(),
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
# pip's --platform takes tags literally: a glibc 2.31 host (the locks' target, Makefile
# UV_COMPILE) also runs every older manylinux wheel.
MANYLINUX_2_31_X86_64 = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(31, 4, -1)] + [
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux2010_x86_64",
    "--platform=manylinux1_x86_64",
]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#\\]+)", re.M)


def pins(lock: str) -> dict[str, Version]:
    text = (ROOT / "requirements" / f"{lock}.lock").read_text()
    found = {canonicalize_name(name): Version(version) for name, version in PIN.findall(text)}
    assert found, f"{lock}.lock pins nothing"
    return found


def direct_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def mismatches(lock: str) -> list[str]:
    """Direct dependencies of pyproject.toml that `lock` lacks or pins outside their range."""
    locked = pins(lock)
    problems = []
    for requirement in direct_requirements(LOCKS[lock]):
        if requirement.marker is not None and not requirement.marker.evaluate(TARGET_ENVIRONMENT):
            continue
        name = canonicalize_name(requirement.name)
        if name not in locked:
            problems.append(f"{requirement} is not in {lock}.lock")
        elif not requirement.specifier.contains(locked[name], prereleases=True):
            problems.append(f"{lock}.lock pins {name}=={locked[name]}, outside {requirement}")
    return problems


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_direct_dependency_is_pinned_within_its_range(lock):
    assert mismatches(lock) == [], "pyproject.toml changed without `make lock`"


def test_the_check_catches_a_pin_outside_its_range(tmp_path, monkeypatch):
    # The check above must be able to fail: a lock that pins Django 6 against "Django>=5.2,<5.3".
    broken = tmp_path / "requirements"
    broken.mkdir()
    text = (ROOT / "requirements" / "cpu.lock").read_text()
    (broken / "cpu.lock").write_text(re.sub(r"^django==\S+", "django==6.0.1", text, flags=re.M))
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert any("django==6.0.1" in problem for problem in mismatches("cpu"))


def test_each_lock_has_the_torch_build_of_its_target():
    cpu, gpu = pins("cpu"), pins("gpu")
    assert cpu["torch"].local == "cpu", "the CPU lock must pin the CPU build (no CUDA download)"
    assert gpu["torch"].local is None, "the GPU lock's torch is PyPI's CUDA build"
    assert "vllm" in gpu and "vllm" not in cpu
    # The trainer runs the same library code on both targets: the versions its tests ran with.
    for name in ("torch", "transformers", "peft", "safetensors", "tokenizers", "huggingface-hub"):
        assert cpu[name].public == gpu[name].public, name


def test_installs_use_the_locks():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK \?= requirements/cpu\.lock$", makefile, re.M)
    assert "$(LOCK)" in re.search(r"^STAMP := .*$", makefile, re.M).group(0), "the stamp must hash the lock"
    install = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    pip_installs = [line for line in install.splitlines() if "pip install" in line and "pip==" not in line]
    assert all("-c $(LOCK)" in line or "--no-deps" in line for line in pip_installs), pip_installs
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY requirements ./requirements" in dockerfile
    assert "lock=requirements/gpu.lock" in dockerfile and "lock=requirements/cpu.lock" in dockerfile
    assert dockerfile.count('-c "$lock"') == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make audit" in ci


def pip_resolve(lock: str, *extra: str) -> dict[str, Version]:
    """What pip would install from `lock` alone (dependencies resolved, nothing installed)."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    command += ["--only-binary=:all:", "--report", "-", "-r", str(ROOT / "requirements" / f"{lock}.lock")]
    done = subprocess.run(
        command + list(extra),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    return {
        canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"])
        for item in report["install"]
    }


@pytest.mark.slow
def test_gpu_lock_resolves_against_the_index_for_a_linux_gpu_worker():
    """pip, with no config of this machine's (no local wheels, no constraints), resolves the GPU
    lock for manylinux_2_31 x86_64 / CPython 3.11 to exactly its pins: no conflict, nothing missing."""
    resolved = pip_resolve(
        "gpu",
        "--isolated",
        "--index-url=https://pypi.org/simple",
        *MANYLINUX_2_31_X86_64,
        "--python-version=3.11",
        "--implementation=cp",
    )
    assert resolved == pins("gpu")


@pytest.mark.slow
def test_cpu_lock_resolves_as_make_install_does():
    """With this machine's pip config (its local CPU torch wheel), the CPU lock resolves to exactly
    its pins: `make install` installs what the lock says."""
    assert pip_resolve("cpu") == pins("cpu")


def run_audit(tmp_path: Path, report: dict, *, strict: bool = False) -> subprocess.CompletedProcess:
    """.ci/audit over the CPU lock with a stand-in pip-audit that answers `report` (pip-audit's
    JSON format) and keeps the requirements file it was given."""
    fake = tmp_path / "pip-audit"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, shutil, sys\n"
        f"report = json.loads({json.dumps(json.dumps(report))})\n"
        f"shutil.copy(sys.argv[sys.argv.index('-r') + 1], {str(tmp_path / 'audited.txt')!r})\n"
        "print(json.dumps(report))\n"
        "sys.exit(1 if any(d.get('vulns') for d in report['dependencies']) else 0)\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PIP_AUDIT": str(fake), "AUDIT_STRICT": "1" if strict else "0"}
    return subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "audit"), str(ROOT / "requirements" / "cpu.lock")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_audit_fails_on_a_known_vulnerability_and_names_it(tmp_path):
    vuln = {"id": "GHSA-test-0001", "fix_versions": ["3.1.7"], "aliases": [], "description": "x"}
    report = {"dependencies": [{"name": "jinja2", "version": "3.1.6", "vulns": [vuln]}], "fixes": []}
    done = run_audit(tmp_path, report)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "jinja2==3.1.6: GHSA-test-0001 (fixed in: 3.1.7)" in done.stdout
    # Vulnerability databases know releases: the CPU build of torch is audited as its release.
    audited = (tmp_path / "audited.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", audited, re.M) and "+cpu" not in audited


def test_audit_never_counts_an_unaudited_package_as_clean(tmp_path):
    report = {
        "dependencies": [
            {"name": "tqdm", "version": "4.70.1", "vulns": []},
            {"name": "accelerate", "skip_reason": "Dependency not found on PyPI"},
        ],
        "fixes": [],
    }
    done = run_audit(tmp_path, report)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 audited, 1 NOT audited" in done.stdout and "WARNING" in done.stdout
    assert "OK: no known vulnerabilities" not in done.stdout
    assert run_audit(tmp_path, report, strict=True).returncode == 2
    clean = {"dependencies": [{"name": "tqdm", "version": "4.70.1", "vulns": []}], "fixes": []}
    done = run_audit(tmp_path, clean, strict=True)
    assert done.returncode == 0 and "OK: no known vulnerabilities" in done.stdout
