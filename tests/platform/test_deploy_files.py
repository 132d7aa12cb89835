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
    names = set(re.findall(r'env_(?:str|bool|int|float|list|choice)\(\s*"([A-Z0-9_]+)"', source))
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
    queues = interpolated(words[words.index("-Q") + 1]).split(",")
    from projects.queues import Queue

    assert set(queues) == {q.value for q in Queue}


# ----------------------------------------------------------------------------- serving and storage
_INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?:(:?-)([^}]*)|:\?[^}]*)?\}")


def interpolated(value: str, given: dict[str, str] | None = None) -> str:
    """A compose value as `docker compose` would see it with ``given`` in the environment:
    ``${X:-default}``/``${X-default}`` take their default, ``${X:?message}`` a placeholder."""

    def one(match: re.Match) -> str:
        name, default = match.group(1), match.group(3)
        if given and name in given:
            return given[name]
        return default if default is not None else f"<{name}>"

    return _INTERPOLATION.sub(one, value)


def _app_env(name: str) -> dict[str, str]:
    return {
        key: interpolated(str(value)) for key, value in compose()["services"][name]["environment"].items()
    }


def test_compose_serves_inference_and_stores_checkpoints_in_a_bucket():
    services = compose()["services"]
    assert {"inference", "storage"} <= set(services)
    for name in ("web", "worker", "beat", "inference"):
        assert _app_env(name)["STORAGE_BACKEND"] == "s3", name


def test_every_service_has_a_healthcheck_on_its_own_port():
    for name, service in compose()["services"].items():
        check = service.get("healthcheck", {}).get("test")
        assert check and check[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
        text = " ".join(check[1:])
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/\S*?)'", text)
        if url:  # an HTTP check must dial the port the service's own command listens on
            words = _command(service)
            assert words[words.index("--port") + 1] == url.group(1), name
    web = " ".join(compose()["services"]["web"]["healthcheck"]["test"])
    assert "/healthz" in web and (ROOT / "artweb" / "urls.py").read_text().count('path("healthz"') == 1
    assert "/health'" in " ".join(compose()["services"]["inference"]["healthcheck"]["test"])
    # A service that others wait for is one whose healthcheck they can wait on.
    for name, service in compose()["services"].items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)


def test_storage_service_is_the_bucket_the_app_is_configured_for():
    services = compose()["services"]
    storage = services["storage"]
    env = _app_env("web")
    endpoint = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", env["STORAGE_S3_ENDPOINT_URL"])
    assert endpoint, env["STORAGE_S3_ENDPOINT_URL"]
    assert endpoint.group(1) == "storage"
    command = storage["command"]
    assert command[0] == "server"
    assert command[command.index("--address") + 1] == f":{endpoint.group(2)}"
    # MinIO's root user is the key pair the app signs with: the same variables, the same defaults.
    raw_app = services["web"]["environment"]
    assert storage["environment"]["MINIO_ROOT_USER"] == raw_app["STORAGE_S3_ACCESS_KEY_ID"]
    assert storage["environment"]["MINIO_ROOT_PASSWORD"] == raw_app["STORAGE_S3_SECRET_ACCESS_KEY"]
    # Its data folder is a named volume, declared.
    mounts = dict(volume.split(":", 1)[::-1] for volume in storage["volumes"])
    assert command[1] in mounts and mounts[command[1]] in compose()["volumes"]
    # The web service creates the bucket (storage_check) before it serves, and everything that
    # reads or writes checkpoints waits for the store.
    assert "storage_check --create-bucket" in services["web"]["command"][2]
    assert "storage" in services["web"]["depends_on"]
    # An operator can point every service at an external bucket from .env: these names are settings.
    known = settings_env_names()
    for name in re.findall(r"\$\{([A-Z0-9_]+)", (ROOT / "docker-compose.yml").read_text()):
        if name.startswith("STORAGE_") or name.startswith("INFERENCE_"):
            assert name in known or name == "INFERENCE_BASE_MODEL", name


def test_storage_settings_are_checked_like_the_compose_file_sets_them(monkeypatch):
    """The names and values compose sets are ones settings accepts (and an s3 backend without a
    bucket fails at start)."""
    import subprocess
    import sys

    env = {**os.environ, **_app_env("web"), "DATABASE_URL": "sqlite:///:memory:", "ARTWEB_DATA_DIR": "/tmp"}
    script = "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='artweb.settings'; django.setup(); from django.conf import settings as s; print(s.STORAGE_BACKEND, s.STORAGE_S3_BUCKET, s.STORAGE_S3_ENDPOINT_URL, s.CHECKPOINT_DIR)"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["s3", "artweb", "http://storage:9000", "/data/checkpoints"]
    env["STORAGE_S3_BUCKET"] = ""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "STORAGE_S3_BUCKET" in result.stderr


def test_inference_service_runs_serve_inference_with_valid_arguments():
    from artweb.management.commands.serve_inference import ENGINES, Command

    service = compose()["services"]["inference"]
    words = [interpolated(word) for word in _command(service)]
    assert words[:3] == ["python", "manage.py", "serve_inference"]
    options = Command().create_parser("manage.py", "serve_inference").parse_args(words[3:])
    assert options.base_model and options.host == "0.0.0.0"
    assert options.url == f"http://inference:{options.port}"  # what the gateway dials in the network
    env = _app_env("inference")
    assert env["INFERENCE_ENGINE"] == "vllm" and env["INFERENCE_ENGINE"] in ENGINES
    # It loads only checkpoints under its adapter root: the folder where its fetched copies land.
    assert env["INFERENCE_ADAPTER_ROOT"] == env["ARTWEB_CHECKPOINT_DIR"]


def test_gpu_services_reserve_a_gpu_and_install_the_gpu_extra():
    services = compose()["services"]
    for name in ("worker", "trainer", "inference"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), name
        assert services[name]["build"]["args"]["EXTRAS"] == "gpu", name
    for name in ("web", "beat", "postgres", "redis", "storage"):
        assert "deploy" not in services[name], f"{name} should not hold a GPU"


def test_volumes_match_the_settings():
    services = compose()["services"]
    declared = set(compose()["volumes"])
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert source in declared, f"{name} mounts undeclared volume {source}"
        if "build" not in service:
            continue
        env = _app_env(name)
        mounts = {target: source for source, target in (v.split(":", 1) for v in service["volumes"])}
        data_dir = env["ARTWEB_DATA_DIR"]
        assert mounts.get(data_dir) == "data", f"{name} does not keep ARTWEB_DATA_DIR on the data volume"
        for setting in ("ARTWEB_CHECKPOINT_DIR", "INFERENCE_ADAPTER_ROOT", "INFERENCE_CACHE_DIR"):
            if setting in env:
                assert Path(env[setting]).is_relative_to(data_dir), (name, setting)
        words = _command(service)
        if "--schedule" in words:
            assert Path(words[words.index("--schedule") + 1]).is_relative_to(data_dir), name


def test_manage_py_commands_in_compose_exist():
    from django.core.management import get_commands

    commands = set(get_commands())  # Django's own (migrate) and the project's (storage_check, ...)
    for name, service in compose()["services"].items():
        if "build" not in service:
            continue
        text = (
            service["command"][2] if service["command"][:2] == ["sh", "-c"] else " ".join(service["command"])
        )
        for command in re.findall(r"manage\.py (\w+)", text):
            assert command in commands, f"{name} runs manage.py {command}, which does not exist"


def _many_hosts_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("### Many hosts")
    return text[start : text.index("\n## ", start)]


def test_the_many_hosts_section_and_the_compose_profiles_are_in_step():
    """Every profiled service (what a further host runs) and the command that starts it are in the
    README's "Many hosts"; every variable a further host sets to reach the first is named there and
    used by the compose file; the profile's worker consumes its own queue, one task at a time."""
    section = _many_hosts_section()
    text = (ROOT / "docker-compose.yml").read_text()
    services = compose()["services"]
    profiled = {name: service for name, service in services.items() if service.get("profiles")}
    assert len(profiled) >= 2, "a second worker profile: a worker and an inference server"
    for profile in {p for service in profiled.values() for p in service["profiles"]}:
        members = sorted(name for name, service in profiled.items() if profile in service["profiles"])
        command = re.compile(rf"docker compose --profile {re.escape(profile)} up -d --no-deps ([a-z0-9 -]+)")
        for where in (section, text):
            started = command.search(where)
            assert started and sorted(started.group(1).split()) == members, (profile, members)
        workers = [name for name in members if _command(services[name])[:3] == ["python", "-m", "celery"]]
        assert workers, profile
        for name in workers:
            words = _command(services[name])
            assert interpolated(words[words.index("-Q") + 1]) == profile  # its class's queue only
            assert (
                words[words.index("-c") + 1] == "1" and words[words.index("--prefetch-multiplier") + 1] == "1"
            )
            assert "depends_on" not in services[name], "a further host runs it alone (--no-deps)"
    for name in profiled:
        assert f"`{name}`" in section, name
    for variable in re.findall(r"`([A-Z][A-Z0-9_]+)`", section):
        assert "${" + variable in text, f"the README names {variable}, which compose does not read"
    for needed in ("POSTGRES_HOST", "REDIS_HOST", "STORAGE_S3_ENDPOINT_URL", "GPU_LARGE_INFERENCE_URL"):
        assert f"`{needed}`" in section, needed
    app_env = _app_env("worker-gpu-large")
    assert "${POSTGRES_HOST" in compose()["x-app-env"]["DATABASE_URL"] and app_env["STORAGE_BACKEND"] == "s3"


def test_each_hosts_workers_train_on_that_hosts_trainer_service():
    """Every worker names a trainer service of its own host (a compose service of its profile, on
    the port that service listens on), with the token the service reads; the service writes where
    the worker reads checkpoints from (the data volume's checkpoint folder) and is reached by no one
    else (no published port)."""
    services = compose()["services"]
    workers = {name: s for name, s in services.items() if "command" in s
               and _command(s)[:3] == ["python", "-m", "celery"] and "worker" in _command(s)}  # fmt: skip
    assert {"worker", "worker-gpu-large"} <= set(workers)
    for name, worker in workers.items():
        env = _app_env(name)
        url = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", env["TRAINER_SERVICE_URL"])
        assert url, (name, env["TRAINER_SERVICE_URL"])
        trainer = services[url.group(1)]
        assert trainer.get("profiles") == worker.get("profiles"), (name, url.group(1))
        words = [interpolated(w) for w in _command(trainer)]
        assert words[:3] == ["python", "-m", "training.hosting.service"]
        assert (
            words[words.index("--port") + 1] == url.group(2) and words[words.index("--host") + 1] == "0.0.0.0"
        )
        assert words[words.index("--root") + 1] == env["ARTWEB_CHECKPOINT_DIR"]
        assert "ports" not in trainer, f"{url.group(1)} answers the workers only"
        assert "TRAINER_SERVICE_TOKEN" not in " ".join(words)  # the token is read from the environment
        token = services[name]["environment"]["TRAINER_SERVICE_TOKEN"]
        assert trainer["environment"]["TRAINER_SERVICE_TOKEN"] == token and token.startswith(
            "${TRAINER_SERVICE_TOKEN:?"
        )
    from training.hosting.service import main  # noqa: F401  (the module the command runs)


def _published(entry: object, given: dict[str, str] | None = None) -> tuple[str, str]:
    """(host address, container port) of a compose ``ports`` entry with the defaults (or ``given``)
    interpolated; "" as the address: every interface."""
    if isinstance(entry, dict):  # the long syntax
        return str(entry.get("host_ip", "")), str(entry["target"])
    parts = interpolated(str(entry), given).split("/")[0].rsplit(":", 2)
    if len(parts) == 3:
        return parts[0].strip("[]"), parts[2]
    return "", parts[-1]


def test_no_model_trainer_or_metrics_port_is_published_on_every_interface():
    """By default only the web's port is published to all interfaces; the inference servers, their
    checkpoint fetchers, the trainer services and the workers' metrics answer the compose network
    (and, where a further host must reach one, a private address the operator names). The compose
    file says how to open one."""
    from training.serving.binding import is_loopback

    seen = {}
    for name, service in compose()["services"].items():
        for entry in service.get("ports", []):
            address, port = _published(entry)
            seen[(name, port)] = address
            if (name, port) == ("web", "8000"):
                continue
            assert address and address not in ("0.0.0.0", "::"), f"{name} publishes {port} on every interface"
            assert is_loopback(address), f"{name} publishes {port} on {address} by default"
    assert seen[("web", "8000")] == ""
    # The gpu-large inference server (dialled by the first host's web) opens on the address named.
    gpu_large = compose()["services"]["inference-gpu-large"]["ports"]
    assert {_published(e, {"GPU_LARGE_PUBLISH_ADDRESS": "10.0.0.12"}) for e in gpu_large} == {
        ("10.0.0.12", "8100"),
        ("10.0.0.12", "8101"),
    }
    text = (ROOT / "docker-compose.yml").read_text()
    assert "127.0.0.1:8100:8100" in text and "docker-compose.override.yml" in text  # how to open one
    assert "`GPU_LARGE_PUBLISH_ADDRESS`" in _many_hosts_section()
