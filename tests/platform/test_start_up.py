"""A Django process starts without the libraries that load weights.

torch, transformers and peft cost about 4 s of CPU to import on these machines. Every web server,
management command and test subprocess starts Django; only the work that trains or samples
(the Celery worker's jobs, the inference server) needs them, and loads them when it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "peft", "tinker")

# What a web server and each management command import at start: the settings, every URL's view
# module, and the commands (serve_inference loads its engine only once it runs).
START = """
import json, sys
import django
django.setup()
from django.urls import get_resolver
get_resolver().url_patterns
import artweb.asgi, artweb.wsgi
for name in ("up", "demo", "createapikey", "registerbasemodel", "storage_check", "serve_inference"):
    __import__(f"artweb.management.commands.{name}")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)))
"""


def _loaded(code: str, tmp_path: Path) -> list[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "artweb.settings", "ARTWEB_DATA_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_django_process_starts_without_torch_transformers_or_peft(tmp_path):
    loaded = _loaded(START % (HEAVY,), tmp_path)
    assert not loaded, f"imported at a Django process's start: {loaded[:10]}"


def test_the_check_sees_a_heavy_import(tmp_path):
    """The check above can fail: the same process, asked to import the trainer's session, reports torch."""
    loaded = _loaded(
        START.replace("import artweb.asgi", "import training.session.local, artweb.asgi") % (HEAVY,), tmp_path
    )
    assert "torch" in loaded and "peft" in loaded
