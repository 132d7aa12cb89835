"""docker-compose.yml and the Dockerfile must describe things that exist (no Docker engine runs here)."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def settings_env_names() -> set[str]:
    source = (ROOT / "artweb" / "settings.py").read_text()
    names = set(re.findall(r'env_(?:str|bool|int|float|list)\(\s*"([A-Z0-9_]+)"', source))
    return names | {f"{name}_FILE" for name in names}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_has_the_production_services():
    services = compose()["services"]
    assert {"web", "worker", "beat", "postgres", "redis"} <= set(services)


def test_every_build_context_and_dockerfile_exists():
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build is None:
            assert "image" in service, f"{name} has neither build nor image"
            continue
        context = ROOT / build["context"]
        assert context.is_dir(), name
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, list[str]]]  # (INSTRUCTION, its words), continuations joined

    def words(self, instruction: str) -> list[list[str]]:
        return [words for name, words in self.instructions if name == instruction]

    def runs(self) -> str:
        return " ".join(" ".join(words) for words in self.words("RUN"))


def dockerfile_stages() -> list[Stage]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, *words = line.split()
        if instruction == "FROM":
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image=words[0], name=name, instructions=[]))
        else:
            stages[-1].instructions.append((instruction, words))
    return stages


def _copy_parts(words: list[str]) -> tuple[dict[str, str], list[str], str]:
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1], paths[-1]


def test_dockerfile_copies_only_existing_paths():
    for stage in dockerfile_stages():
        for words in stage.words("COPY"):
            flags, sources, _ = _copy_parts(words)
            if "from" in flags:
                continue  # from an earlier stage: test_dockerfile_builds_the_dashboard_vendor_files
            for source in sources:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def _vendor_script_outputs() -> tuple[str, set[str]]:
    """What frontend/scripts/copy_vendor.mjs writes: its target folder (relative to frontend/) and
    the file names it puts there."""
    script = (ROOT / "frontend" / "scripts" / "copy_vendor.mjs").read_text()
    target = re.search(r"const target = join\(root, ([^)]*)\)", script)
    assert target, "copy_vendor.mjs no longer names its target as join(root, ...)"
    folder = "/".join(re.findall(r'"([^"]+)"', target.group(1)))
    names = set(re.findall(r'\["node_modules/[^"]+",\s*"([^"]+)"\]', script))
    assert names, "copy_vendor.mjs copies no files"
    return folder, names


def _resolve(workdir: str, path: str) -> str:
    return os.path.normpath(path if path.startswith("/") else os.path.join(workdir, path))


def _workdir_before(stage: Stage, index: int) -> str:
    workdir = "/"
    for name, words in stage.instructions[:index]:
        if name == "WORKDIR":
            workdir = _resolve(workdir, words[0])
    return workdir


def test_dockerfile_builds_the_dashboard_vendor_files():
    """An image built from a fresh clone (no node_modules, no static/vendor) must carry htmx and
    Chart.js: a Node stage runs `npm ci` and the copy script, and the final stage copies exactly
    that script's output folder to where the app's static files live — and nothing else of Node."""
    stages = dockerfile_stages()
    final = stages[-1]
    vendor_folder, vendor_files = _vendor_script_outputs()

    # Every vendor file a template loads is one the script produces.
    for template in (ROOT / "frontend" / "templates").rglob("*.html"):
        for name in re.findall(r"{% static ['\"]vendor/([^'\"]+)['\"] %}", template.read_text()):
            assert name in vendor_files, (
                f"{template.name} loads vendor/{name}, which copy_vendor.mjs never writes"
            )

    copies_from = [
        (index, _copy_parts(words))
        for index, (name, words) in enumerate(final.instructions)
        if name == "COPY" and any(w.startswith("--from=") for w in words)
    ]
    assert copies_from, "the final stage copies nothing from a build stage: no htmx / Chart.js in the image"
    vendor_copies = []
    for index, (flags, sources, destination) in copies_from:
        builder = next((s for s in stages[:-1] if s.name == flags["from"]), None)
        assert builder is not None, f"COPY --from={flags['from']} names no earlier stage"
        assert builder.image.startswith("node:"), builder.image
        runs = builder.runs()
        assert "npm ci" in runs and "node scripts/copy_vendor.mjs" in runs, runs
        builder_copies = {source for words in builder.words("COPY") for source in _copy_parts(words)[1]}
        assert {
            "frontend/package.json",
            "frontend/package-lock.json",
            "frontend/scripts",
        } <= builder_copies, builder_copies
        # The script writes <its frontend folder>/<vendor_folder>; that folder is what is copied.
        script_root = _workdir_before(builder, len(builder.instructions))
        assert [_resolve("/", s) for s in sources] == [_resolve(script_root, vendor_folder)], sources
        assert not any("node_modules" in s for s in sources)
        vendor_copies.append(_resolve(_workdir_before(final, index), destination))
    app = _workdir_before(final, len(final.instructions))
    assert vendor_copies == [f"{app}/frontend/static/vendor"], vendor_copies

    # The final image has no Node and no node_modules: it is not a node image, runs no npm, and
    # the build context leaves out a working tree's node_modules and stale vendor copies.
    assert not final.image.startswith("node:")
    assert "npm" not in final.runs()
    for words in final.words("COPY"):
        assert not any("node_modules" in w for w in words), words
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {"frontend/node_modules", "frontend/static/vendor", ".venv"} <= ignored, ignored


def test_every_environment_variable_is_a_setting():
    known = settings_env_names()
    for name, service in compose()["services"].items():
        if "build" not in service:
            continue
        env = service.get("environment", {})
        assert env, f"{name} has no environment"
        unknown = set(env) - known
        assert not unknown, f"{name} sets variables that artweb/settings.py never reads: {unknown}"
        assert {"DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY"} <= set(env), name
        assert env["DATABASE_URL"].startswith("postgres://") and env["CELERY_BROKER_URL"].startswith(
            "redis://"
        )


def _command(service: dict) -> list[str]:
    command = service["command"]
    if isinstance(command, str):
        command = shlex.split(command)
    if command[:2] == ["sh", "-c"]:
        return shlex.split(command[2])
    return command


def test_commands_refer_to_real_entry_points():
    import importlib

    for _name, service in compose()["services"].items():
        if "build" not in service:
            continue
        words = _command(service)
        for i, word in enumerate(words):
            if word == "-A":
                assert importlib.import_module(words[i + 1]).celery_app is not None
            if ":application" in word:
                module, attribute = word.split(":")
                assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), word
                assert f"{attribute} =" in (ROOT / (module.replace(".", "/") + ".py")).read_text()
            if word == "manage.py":
                assert (ROOT / "manage.py").is_file()


def test_worker_runs_one_task_at_a_time():
    words = _command(compose()["services"]["worker"])
    assert words[words.index("-c") + 1] == "1"
    assert words[words.index("--prefetch-multiplier") + 1] == "1"
    queues = words[words.index("-Q") + 1].split(",")
    from projects.queues import Queue

    assert set(queues) == {q.value for q in Queue}
