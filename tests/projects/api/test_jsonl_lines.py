"""JSON Lines are split on ``\\n`` only (issue 51, must-have 9): a row holding U+2028, U+2029 or
U+0085 unescaped inside a JSON string (valid JSON; ``json.dumps(..., ensure_ascii=False)`` writes
them so) is one row, through ``/v1/files`` (upload, stored rows, content read back) and through a
task-set upload, as a file and as JSONL text. ``str.splitlines()`` split such a row in two."""

from __future__ import annotations

import io
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from projects import services
from projects.models import TaskRow
from tests.projects.api.test_fine_tuning_api import _connection_kept_open, client_for  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

ODD = "a\u2028b\u2029c\x85d"  # line separators to str.splitlines(), ordinary characters to JSON
RL_ROWS = [{"messages": [{"role": "user", "content": f"Say {ODD} {n}"}], "answer": ODD} for n in range(3)]


def raw_jsonl(rows, newline: str = "\n") -> bytes:
    text = newline.join(json.dumps(row, ensure_ascii=False) for row in rows) + newline
    assert "\u2028" in text  # written raw, not as an escape: what the bug split on
    return text.encode()


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_row_holding_u2028_round_trips_through_v1_files(alpha_key, tiny_model_dir, newline):
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    client = client_for(alpha_key)
    uploaded = client.files.create(
        file=("odd.jsonl", io.BytesIO(raw_jsonl(RL_ROWS, newline))), purpose="fine-tune"
    )
    assert uploaded.status == "processed"
    stored = [row.data for row in TaskRow.objects.filter(task_set_id=int(uploaded.id[5:])).order_by("index")]
    assert [row["item"]["answer"] for row in stored] == [ODD] * 3
    assert stored[1]["messages"][0]["content"] == f"Say {ODD} 1"
    content = client.files.content(uploaded.id).text
    assert [json.loads(line) for line in content.split("\n") if line] == RL_ROWS


def test_a_row_holding_u2028_is_one_row_in_a_task_set_upload(alpha_setup, alice_client):
    rows = [{"messages": [{"role": "user", "content": ODD}], "item": {"answer": ODD}}, {"prompt": f"p {ODD}"}]
    upload = SimpleUploadedFile("odd.jsonl", raw_jsonl(rows), content_type="application/jsonl")
    as_file = alice_client.post(
        "/api/v1/task-sets/",
        {"project": alpha_setup.project.pk, "name": "f", "file": upload},
        format="multipart",
    )
    assert as_file.status_code == 201, as_file.json()
    assert as_file.json()["row_count"] == 2
    stored = [row.data for row in TaskRow.objects.filter(task_set_id=as_file.json()["id"]).order_by("index")]
    assert stored[0]["messages"][0]["content"] == ODD and stored[0]["item"]["answer"] == ODD
    as_text = alice_client.post(
        "/api/v1/task-sets/",
        {"project": alpha_setup.project.pk, "name": "t", "jsonl": raw_jsonl(rows).decode()},
        format="json",
    )
    assert as_text.status_code == 201 and as_text.json()["row_count"] == 2, as_text.json()


def test_a_broken_line_is_still_named_by_its_number_counting_only_newlines(alpha_setup, alice_client):
    jsonl = json.dumps({"prompt": ODD}, ensure_ascii=False) + "\n" + '{"prompt": \n'
    response = alice_client.post(
        "/api/v1/task-sets/",
        {"project": alpha_setup.project.pk, "name": "bad", "jsonl": jsonl},
        format="json",
    )
    assert response.status_code == 400
    assert "line 2" in json.dumps(response.json()) and "line 3" not in json.dumps(response.json())
