"""The checkpoint fetcher a vLLM host runs beside vLLM (training.serving.fetch_server)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from training.serving.fetch_cache import FetchedCheckpoints
from training.serving.fetch_server import FETCH_PATH, start_fetch_server

SHA = "a" * 64


@pytest.fixture
def fetcher(tmp_path):
    stored = tmp_path / "store" / "model-1" / "step-000001"
    stored.mkdir(parents=True)
    (stored / "adapter_config.json").write_text("{}")

    def fetch(key: str, sha256: str) -> Path:
        if key != "model-1/step-000001":
            raise FileNotFoundError(key)
        if sha256 != SHA:
            raise ValueError("contents have another digest")
        return stored

    server = start_fetch_server(
        FetchedCheckpoints(fetch, root=None), host="127.0.0.1", port=0, token="secret"
    )
    yield f"http://127.0.0.1:{server.server_address[1]}", stored
    server.shutdown()


def post(url: str, body: object, token: str = "secret", path: str = FETCH_PATH) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_stored_checkpoint_is_answered_with_its_local_folder(fetcher):
    url, stored = fetcher
    assert post(url, {"key": "model-1/step-000001", "sha256": SHA}) == (200, {"path": str(stored.resolve())})


@pytest.mark.parametrize(
    ("body", "token", "status", "code"),
    [
        ({"key": "model-1/step-000001", "sha256": SHA}, "wrong", 401, "invalid_api_key"),
        ({"key": "model-1/step-000001"}, "secret", 400, "invalid_request"),
        ({"key": "model-1/step-000001", "sha256": "not-hex"}, "secret", 400, "invalid_request"),
        ({"key": 3, "sha256": SHA}, "secret", 400, "invalid_request"),
        ({"key": "model-1/step-000009", "sha256": SHA}, "secret", 404, "model_not_found"),
        ({"key": "model-1/step-000001", "sha256": "b" * 64}, "secret", 502, "adapter_fetch_failed"),
    ],
)
def test_refusals_are_openai_error_objects(fetcher, body, token, status, code):
    answered, error = post(fetcher[0], body, token=token)
    assert (answered, error["error"]["code"]) == (status, code)


def test_only_the_fetch_path_is_served(fetcher):
    status, error = post(fetcher[0], {}, path="/v1/other")
    assert (status, error["error"]["code"]) == (404, "not_found")


def test_the_caches_series_are_on_its_metrics(fetcher):
    url, _ = fetcher
    post(url, {"key": "model-1/step-000001", "sha256": SHA})
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": "Bearer secret"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    assert "artweb_inference_checkpoint_cache_hits_total" in text
    assert "artweb_inference_checkpoint_cache_budget_bytes" in text
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/metrics", timeout=10)
    assert refused.value.code == 401
