"""OpenAI's fine-tuning API (projects.api.fine_tuning) driven by the real `openai` client, in process
(its httpx client on Django's WSGI handler): files in all three formats, jobs of all three
methods and what each becomes (a run of artweb's own), every 400 the client can provoke, tenancy,
read-only keys, events and checkpoints. The end-to-end run with a worker and an inference server
is tests/integration/test_fine_tuning_jobs.py."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest
from django.core.handlers.wsgi import WSGIHandler
from openai import OpenAI

from projects import services
from projects.models import Checkpoint, Run, RunKind, RunStatus, StepMetrics, TaskRow, TaskSet
from projects.services import run_control

pytestmark = pytest.mark.django_db

RL_ROWS = [{"messages": [{"role": "user", "content": f"Say {w}"}], "answer": w} for w in "abcd"]
SFT_ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {w}"},
                  {"role": "assistant", "content": w}]}
    for w in "abcd"
]  # fmt: skip
DPO_ROWS = [
    {"input": {"messages": [{"role": "user", "content": f"Say {w}"}]},
     "preferred_output": [{"role": "assistant", "content": w}],
     "non_preferred_output": [{"role": "assistant", "content": "no"}]}
    for w in "abcd"
]  # fmt: skip
STRING_CHECK = {
    "type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}", "operation": "eq",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _connection_kept_open():
    """Django's handler closes the database connection when a response finishes; the test
    client keeps it open (the test's transaction lives on it), and so does this module's."""
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def jsonl(rows) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode()


def client_for(key: str, **options) -> OpenAI:
    transport = httpx.WSGITransport(app=WSGIHandler())
    return OpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0,
                  http_client=httpx.Client(transport=transport), **options)  # fmt: skip


@pytest.fixture
def ft(alpha_key, tiny_model_dir) -> OpenAI:
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    return client_for(alpha_key)


def upload(client: OpenAI, rows, name="rows.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(rows))), purpose="fine-tune")


def test_files_in_every_format_become_task_sets_and_read_back_in_openai_shape(ft, cast):
    rl, sft, dpo = upload(ft, RL_ROWS, "rl.jsonl"), upload(ft, SFT_ROWS, "sft.jsonl"), upload(ft, DPO_ROWS)
    assert rl.id.startswith("file-") and rl.object == "file" and rl.purpose == "fine-tune"
    assert rl.filename == "rl.jsonl" and rl.bytes == len(jsonl(RL_ROWS)) and rl.status == "processed"
    task_set = TaskSet.objects.get(pk=int(rl.id.removeprefix("file-")))
    assert task_set.project.team == cast.alpha and task_set.project.name == "fine-tuning"
    assert task_set.train_count == 4
    rows = {name: [r.data for r in TaskRow.objects.filter(task_set_id=int(f.id[5:]))] for name, f in
            (("rl", rl), ("sft", sft), ("dpo", dpo))}  # fmt: skip
    assert rows["rl"][0] == {"messages": [{"role": "user", "content": "Say a"}], "item": {"answer": "a"}}
    assert rows["sft"][1] == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say b"}],
        "completion": "b", "item": {"reference": "b"},
    }  # fmt: skip
    assert rows["dpo"][2]["chosen"] == "c" and rows["dpo"][2]["rejected"] == "no"

    assert [f.id for f in ft.files.list()] == [dpo.id, sft.id, rl.id]  # newest first
    assert ft.files.retrieve(sft.id).filename == "sft.jsonl"
    # The content is the rows written back in OpenAI's format: the same lines that were uploaded.
    for f, original in ((rl, RL_ROWS), (sft, SFT_ROWS), (dpo, DPO_ROWS)):
        lines = [json.loads(line) for line in ft.files.content(f.id).text.splitlines()]
        assert lines == original
    deleted = ft.files.delete(rl.id)
    assert deleted.deleted is True and deleted.id == rl.id
    with pytest.raises(openai.NotFoundError):
        ft.files.retrieve(rl.id)


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ("{not json", "line 1: invalid JSON"),
        ('{"prompt": "x"}', "line 1: messages"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "line 1: messages[0].role"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "line 1: messages[0].content"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": []}', "line 1: tools"),
        ('{"input": {"messages": [{"role": "user", "content": "x"}]}, "preferred_output": []}', "line 1: preferred_output"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "line 1: messages: a supervised row needs a user"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}]}',
         "line 1: messages: every assistant message has weight 0"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": '
         '[{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}',
         "line 1: messages[1].tool_calls: the row offers no tools"),
    ],
)  # fmt: skip
def test_a_bad_line_is_a_400_naming_its_line_and_field(ft, line, where):
    with pytest.raises(openai.BadRequestError) as caught:
        ft.files.create(file=("bad.jsonl", io.BytesIO(line.encode())), purpose="fine-tune")
    error = caught.value.body
    assert error["param"] == "file" and where in error["message"], error
    assert not TaskSet.objects.exists()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def weather_call(city: str) -> dict:
    return {"id": f"call-{city}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}  # fmt: skip


TOOL_SFT_ROWS = [
    {"messages": [{"role": "user", "content": f"Weather in {city}?"},
                  {"role": "assistant", "content": None, "tool_calls": [weather_call(city)]},
                  {"role": "tool", "tool_call_id": f"call-{city}", "content": "sunny"},
                  {"role": "assistant", "content": "Maybe.", "weight": 0},
                  {"role": "user", "content": "And?"},
                  {"role": "assistant", "content": f"Sunny in {city}."}],
     "tools": [WEATHER], "parallel_tool_calls": False}
    for city in ("Paris", "Rome", "Oslo", "Lima")
]  # fmt: skip


def test_files_with_tools_train_every_method(ft):
    """Issue 56: lines with tools, tool calls, tool messages and weight 0 are accepted, read back as
    uploaded (null content as ""), and make supervised, reinforcement and DPO jobs."""
    sft = upload(ft, TOOL_SFT_ROWS, "tools.jsonl")
    rows = [r.data for r in TaskRow.objects.filter(task_set_id=int(sft.id[5:]))]
    assert rows[0]["tools"] == [WEATHER] and rows[0]["parallel_tool_calls"] is False
    assert rows[0]["completion"] == "Sunny in Paris." and rows[0]["messages"][3]["weight"] == 0
    lines = [json.loads(line) for line in ft.files.content(sft.id).text.splitlines()]
    expected = json.loads(json.dumps(TOOL_SFT_ROWS).replace('"content": null', '"content": ""'))
    assert lines == expected
    job = ft.fine_tuning.jobs.create(model="tiny", training_file=sft.id, method={"type": "supervised"})
    assert Run.objects.get(pk=int(job.id[6:])).kind == RunKind.SFT

    rl_rows = [{"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
                "parallel_tool_calls": False, "city": "Oslo"}] * 2  # fmt: skip
    grader = {"type": "string_check", "name": "city", "input": "{{sample.output_tools.0.arguments.city}}",
              "reference": "{{item.city}}", "operation": "eq"}  # fmt: skip
    job = ft.fine_tuning.jobs.create(model="tiny", training_file=upload(ft, rl_rows).id,
                                     method={"type": "reinforcement", "reinforcement": {"grader": grader}})  # fmt: skip
    assert Run.objects.get(pk=int(job.id[6:])).task_set.rows.first().data["item"] == {"city": "Oslo"}

    dpo_rows = [{"input": {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER]},
                 "preferred_output": [{"role": "assistant", "content": "", "tool_calls": [weather_call("Rome")]}],
                 "non_preferred_output": [{"role": "assistant", "content": "No idea."}]}] * 2  # fmt: skip
    dpo = upload(ft, dpo_rows)
    assert [json.loads(line) for line in ft.files.content(dpo.id).text.splitlines()] == dpo_rows
    job = ft.fine_tuning.jobs.create(model="tiny", training_file=dpo.id, method={"type": "dpo"})
    assert Run.objects.get(pk=int(job.id[6:])).kind == RunKind.DPO


def test_purpose_other_than_fine_tune_is_refused(ft):
    with pytest.raises(openai.BadRequestError) as caught:
        ft.files.create(file=("a.jsonl", io.BytesIO(jsonl(RL_ROWS))), purpose="assistants")
    assert caught.value.body["param"] == "purpose"


def test_a_reinforcement_job_is_a_platform_run_with_the_grader_and_hyperparameters_mapped(ft, cast):
    train, valid = upload(ft, RL_ROWS), upload(ft, RL_ROWS[:2])
    grader = {"type": "multi", "graders": {"exact": STRING_CHECK}, "calculate_output": "exact"}
    job = ft.fine_tuning.jobs.create(
        model="tiny", training_file=train.id, validation_file=valid.id, suffix="Words!", seed=7,
        metadata={"ci": "yes"},
        method={"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {
            "n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 2.0, "compute_multiplier": 2,
            "eval_interval": 1, "eval_samples": 2}}},
    )  # fmt: skip
    assert job.id.startswith("ftjob-") and job.object == "fine_tuning.job" and job.status == "queued"
    assert job.training_file == train.id and job.validation_file == valid.id and job.seed == 7
    assert job.user_provided_suffix == "Words!" and job.metadata == {"ci": "yes"} and job.model == "tiny"
    assert job.fine_tuned_model is None and job.trained_tokens is None and job.error is None
    assert job.method.type == "reinforcement"
    run = Run.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    assert run.kind == RunKind.PLATFORM and run.project.team == cast.alpha
    assert run.model.name.startswith("ft-words-") and run.model.base_model.name == "tiny"
    assert run.config["steps"] == 4 and run.config["groups_per_step"] == 2  # 2 epochs × 4 rows / 2
    # The measured recipe (fine_tuning.RECIPES: the demo's), scaled by the multipliers.
    assert run.config["learning_rate"] == pytest.approx(2 * 1e-3) and run.config["group_size"] == 16  # 8 × 2
    assert run.config["lr_schedule"] == "cosine" and run.config["ppo_epochs"] == 2
    assert run.config["dynamic_sampling"] is True  # the demo's is off, for its length penalty only
    assert run.config["seed"] == 7 and run.config["eval_interval"] == 1
    assert run.config["eval_samples_per_row"] == 2
    assert run.reward.spec["type"] == "multi"
    assert (run.task_set.train_count, run.task_set.validation_count) == (4, 2)
    # The same object everywhere: the run in the REST API, the job in the list and by id.
    assert [j.id for j in ft.fine_tuning.jobs.list()] == [job.id]
    assert ft.fine_tuning.jobs.retrieve(job.id).hyperparameters.batch_size == 2
    assert [j.id for j in ft.fine_tuning.jobs.list(metadata={"ci": "yes"})] == [job.id]
    assert list(ft.fine_tuning.jobs.list(metadata={"ci": "no"})) == []
    # In the dashboard: the run's page says it is this job.
    from django.test import Client

    browser = Client()
    browser.force_login(cast.alice)
    page = browser.get(f"/runs/{run.pk}/").content.decode()
    assert f"ftjob-{run.pk}" in page and "reinforcement job" in page


def test_supervised_and_dpo_jobs_are_sft_and_dpo_runs(ft):
    sft = ft.fine_tuning.jobs.create(model="tiny", training_file=upload(ft, SFT_ROWS).id,
                                     method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}})  # fmt: skip
    dpo = ft.fine_tuning.jobs.create(model="tiny", training_file=upload(ft, DPO_ROWS).id,
                                     method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.5}}})  # fmt: skip
    sft_run, dpo_run = (Run.objects.get(pk=int(j.id[6:])) for j in (sft, dpo))
    assert sft_run.kind == RunKind.SFT and sft_run.config["steps"] == 2
    assert dpo_run.kind == RunKind.DPO and dpo_run.config["dpo_beta"] == 0.5
    assert sft_run.reward.spec["type"] == "text_similarity"  # held-out answers against the target
    assert dpo.hyperparameters.beta == 0.5
    # The legacy top-level hyperparameters are supervised ones, as OpenAI reads them.
    legacy = ft.fine_tuning.jobs.create(model="tiny", training_file=upload(ft, SFT_ROWS).id,
                                        hyperparameters={"batch_size": 4})  # fmt: skip
    assert (
        legacy.method.type == "supervised"
        and Run.objects.get(pk=int(legacy.id[6:])).config["groups_per_step"] == 4
    )


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.body


def test_every_field_is_honoured_or_refused_with_a_400_naming_it(ft):
    rl, sft = upload(ft, RL_ROWS).id, upload(ft, SFT_ROWS).id
    jobs = ft.fine_tuning.jobs

    def reinforcement(**hyperparameters):
        return {
            "type": "reinforcement",
            "reinforcement": {"grader": STRING_CHECK, "hyperparameters": hyperparameters},
        }

    cases = {
        "model": lambda: jobs.create(model="gpt-4o-mini", training_file=rl, method=reinforcement()),
        # A checkpoint name that is no checkpoint of this team's.
        "model ": lambda: jobs.create(model="fine-tuning/nope:3", training_file=rl, method=reinforcement()),
        "training_file": lambda: jobs.create(model="tiny", training_file="file-999999", method=reinforcement()),
        "validation_file": lambda: jobs.create(model="tiny", training_file=rl, validation_file="nope", method=reinforcement()),
        "suffix": lambda: jobs.create(model="tiny", training_file=rl, suffix="x" * 65, method=reinforcement()),
        "seed": lambda: jobs.create(model="tiny", training_file=rl, seed=-1, method=reinforcement()),
        "metadata": lambda: jobs.create(model="tiny", training_file=rl, metadata={"k": 1}, method=reinforcement()),
        "integrations": lambda: jobs.create(model="tiny", training_file=rl, method=reinforcement(),
                                            integrations=[{"type": "wandb", "wandb": {"project": "p"}}]),
        "method.type": lambda: jobs.create(model="tiny", training_file=rl, method={"type": "distill"}),
        "method.reinforcement.grader": lambda: jobs.create(model="tiny", training_file=rl, method={"type": "reinforcement"}),
        "method.reinforcement.grader.operation": lambda: jobs.create(
            model="tiny", training_file=rl, method={"type": "reinforcement", "reinforcement": {
                "grader": {**STRING_CHECK, "operation": "approximately"}}}),
        "method.reinforcement.hyperparameters.reasoning_effort": lambda: jobs.create(
            model="tiny", training_file=rl, method=reinforcement(reasoning_effort="high")),
        "method.reinforcement.hyperparameters.n_epochs": lambda: jobs.create(
            model="tiny", training_file=rl, method=reinforcement(n_epochs=0)),
        "method.reinforcement.hyperparameters.batch_size": lambda: jobs.create(
            model="tiny", training_file=rl, method=reinforcement(batch_size="big")),
        "method.reinforcement.hyperparameters.learning_rate_multiplier": lambda: jobs.create(
            model="tiny", training_file=rl, method=reinforcement(learning_rate_multiplier=0)),
        "method.reinforcement.hyperparameters.compute_multiplier": lambda: jobs.create(
            model="tiny", training_file=rl, method=reinforcement(compute_multiplier=100)),
        "method.supervised.hyperparameters.beta": lambda: jobs.create(
            model="tiny", training_file=sft, method={"type": "supervised", "supervised": {"hyperparameters": {"beta": 1}}}),
        "method.reinforcement.response_format": lambda: jobs.create(
            model="tiny", training_file=rl, method={"type": "reinforcement", "reinforcement": {
                "grader": STRING_CHECK, "response_format": {"type": "json_object"}}}),
        # An RL file has no assistant targets: it cannot train a supervised job.
        "hyperparameters": lambda: jobs.create(model="tiny", training_file=rl, hyperparameters={"n_epochs": 1},
                                               method={"type": "supervised"}),
    }  # fmt: skip
    for field, call in cases.items():
        error = bad_request(call)
        assert error["param"] == field.strip(), (field, error)
    error = bad_request(lambda: jobs.create(model="tiny", training_file=rl, method={"type": "supervised"}))
    assert error["param"] == "training_file" and "row 0" in error["message"], error
    error = bad_request(lambda: jobs.create(model="tiny", training_file=rl, method={"type": "dpo"}))
    assert error["param"] == "training_file", error
    assert not Run.objects.exists()


def test_another_team_sees_nothing_and_a_read_only_key_cannot_create(ft, cast):
    job = ft.fine_tuning.jobs.create(model="tiny", training_file=upload(ft, SFT_ROWS).id)
    file_id = job.training_file
    outsider = client_for(services.api_key_create(team=cast.beta, name="b").plaintext)
    for call in (
        lambda: outsider.files.retrieve(file_id),
        lambda: outsider.files.content(file_id),
        lambda: outsider.files.delete(file_id),
        lambda: outsider.fine_tuning.jobs.retrieve(job.id),
        lambda: outsider.fine_tuning.jobs.cancel(job.id),
        lambda: outsider.fine_tuning.jobs.list_events(job.id),
        lambda: outsider.fine_tuning.jobs.checkpoints.list(job.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(outsider.files.list()) == [] and list(outsider.fine_tuning.jobs.list()) == []
    error = bad_request(lambda: outsider.fine_tuning.jobs.create(model="tiny", training_file=file_id))
    assert error["param"] == "training_file"
    reader = client_for(services.api_key_create(team=cast.alpha, name="ro", read_only=True).plaintext)
    assert [j.id for j in reader.fine_tuning.jobs.list()] == [job.id]
    for call in (
        lambda: upload(reader, RL_ROWS),
        lambda: reader.fine_tuning.jobs.create(model="tiny", training_file=file_id),
        lambda: reader.fine_tuning.jobs.cancel(job.id),
    ):
        with pytest.raises(openai.PermissionDeniedError):
            call()
    # A file a run trains on cannot be deleted from under it.
    with pytest.raises(openai.ConflictError):
        ft.files.delete(file_id)


def test_the_openai_project_header_names_an_artweb_project(ft, cast, alpha_key):
    project = services.project_create(team=cast.alpha, name="support-bot")
    scoped = client_for(alpha_key, project="support-bot")
    f = upload(scoped, SFT_ROWS)
    assert TaskSet.objects.get(pk=int(f.id[5:])).project == project
    assert [x.id for x in scoped.files.list()] == [f.id] and list(ft.files.list()) == []
    error = bad_request(lambda: upload(client_for(alpha_key, project="nope"), SFT_ROWS))
    assert error["param"] == "OpenAI-Project"


def test_cancel_pause_resume_events_and_checkpoints(ft, cast):
    job = ft.fine_tuning.jobs.create(model="tiny", training_file=upload(ft, SFT_ROWS).id)
    run = Run.objects.get(pk=int(job.id[6:]))
    assert ft.fine_tuning.jobs.pause(job.id).status == "paused"
    assert ft.fine_tuning.jobs.resume(job.id).status == "queued"
    # What a worker records: a step (its metrics event) and a checkpoint.
    from datetime import timedelta

    from django.utils import timezone

    now = timezone.now()
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, started_at=now - timedelta(seconds=30), heartbeat_at=now, current_step=1
    )
    # 1 of 10 steps, itself 20 s of the 30 s since the start: 9 × 20 s to go (the load is no step's)
    StepMetrics.objects.create(
        run=run, step=1, loss=0.5, metrics={"loss": 0.5, "trainable_tokens": 40.0, "step_seconds": 20.0}
    )
    running = ft.fine_tuning.jobs.retrieve(job.id)
    assert running.status == "running" and abs(running.estimated_finish - (now.timestamp() + 180)) <= 2
    services.run_event_add(
        run=run, message="step 1/2: loss 0.5", type="metrics", data={"step": 1, "loss": 0.5}
    )
    checkpoint = Checkpoint.objects.create(
        model=run.model, run=run, step=1, path="/x", metrics={"eval_reward_mean": 0.25}
    )
    events = ft.fine_tuning.jobs.list_events(job.id, limit=2)
    assert [e.type for e in events.data] == ["metrics", "message"] and events.has_more
    assert (
        events.data[0].data["train_loss"] == 0.5 and events.data[0].data["total_steps"] == 10
    )  # "auto" epochs: the default steps
    assert all(e.id.startswith("ftevent-") and e.object == "fine_tuning.job.event" for e in events.data)
    older = ft.fine_tuning.jobs.list_events(job.id, after=events.data[-1].id, limit=100)
    assert older.data and int(older.data[0].id[8:]) < int(events.data[-1].id[8:])
    (listed,) = ft.fine_tuning.jobs.checkpoints.list(job.id).data
    assert listed.id == f"ftckpt-{checkpoint.pk}" and listed.step_number == 1
    assert listed.fine_tuned_model_checkpoint == f"fine-tuning/{run.model.name}:1"
    assert listed.fine_tuning_job_id == job.id and listed.metrics.train_loss == 0.5
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    done = ft.fine_tuning.jobs.retrieve(job.id)
    assert done.fine_tuned_model == listed.fine_tuned_model_checkpoint and done.trained_tokens == 40
    # The result file, as OpenAI fills it once a job has succeeded: the step metrics as CSV.
    (results,) = done.result_files
    assert ft.files.retrieve(results).purpose == "fine-tune-results"
    csv = ft.files.content(results).text.splitlines()
    assert csv[0].startswith("step,train_loss,") and csv[1].startswith("1,0.5,")
    with pytest.raises(openai.ConflictError):
        ft.files.delete(results)
    outsider = client_for(services.api_key_create(team=cast.beta, name="b").plaintext)
    with pytest.raises(openai.NotFoundError):
        outsider.files.content(results)
    with pytest.raises(openai.ConflictError):
        ft.fine_tuning.jobs.cancel(job.id)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED)
    assert ft.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    bad = bad_request(lambda: ft.fine_tuning.jobs.list_events(job.id, after="ftjob-1"))
    assert bad["param"] == "after"
    with pytest.raises(openai.NotFoundError):
        ft.fine_tuning.jobs.retrieve("ftjob-999999")
    assert run_control  # the services the job actions call (imported: they are the run's own)


def test_graders_run_and_validate_answer_as_openais(ft):
    result = ft.fine_tuning.alpha.graders.run(grader=STRING_CHECK, model_sample="b", item={"answer": "b"})
    assert result.reward == 1.0 and result.metadata.type == "string_check"
    valid = ft.fine_tuning.alpha.graders.validate(grader=STRING_CHECK)
    assert valid.grader.type == "string_check"
    error = bad_request(
        lambda: ft.fine_tuning.alpha.graders.validate(grader={**STRING_CHECK, "operation": "x"})
    )
    assert error["param"] == "grader.operation"
