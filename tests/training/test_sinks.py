"""Sinks in the training core that a team's data, a client's request or a model's output reaches,
each tried with its obvious abuse (issue 22's sink review; the table is in the review's report).
Sinks already tried elsewhere are not repeated here: the python grader sandbox
(rewards/test_python_grader.py), the outbound-URL policy (test_outbound.py), the calculator
(environments/test_env_python_tools.py), adapter paths on the inference server
(serving/test_scheduler.py), MCP stdio commands (environments/test_env_registry.py)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import pickle
import socket
import tarfile
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from training.config import ConfigError, LoraSpec, TrainConfig
from training.environments import validate_environment
from training.export import write_archive
from training.rewards import validate_grader
from training.rewards.base import Sample
from training.rewards.errors import GraderSpecError, GradingError
from training.rewards.templates import Template, TemplateSyntaxError
from training.rollouts.tools import parse_tool_calls
from training.safety.outbound import OutboundPolicy
from training.serving.protocol import Limits, RequestError, parse_chat_request
from training.session.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]

# --- deserialisers -------------------------------------------------------------------------------


def _torch_load_calls(path: Path) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    ]


def test_every_torch_load_in_the_code_base_is_weights_only():
    """A checkpoint file is data, never code: torch.load must use the restricted unpickler."""
    offenders = []
    for folder in ("training", "projects", "artweb", "frontend"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for call in _torch_load_calls(path):
                keywords = {k.arg: k.value for k in call.keywords}
                flag = keywords.get("weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert offenders == []


def test_no_module_unpickles_or_loads_yaml():
    """No pickle, marshal, shelve, dill or yaml anywhere in the code a request or a checkpoint reaches."""
    banned = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "yaml", "joblib"}
    offenders = []
    for folder in ("training", "projects", "artweb", "frontend"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in banned
                ]
    assert offenders == []


class _Payload:
    """Unpickling this creates a file: proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("state_file", ["optimizer.pt", "rng_state.pt"])
def test_resuming_from_a_checkpoint_with_a_pickle_payload_runs_no_code(tiny_model, tmp_path, state_file):
    model, tokenizer = tiny_model
    lora = LoraSpec(rank=4, alpha=8)
    checkpoint = tmp_path / "ckpt"
    Policy(model, tokenizer, TrainConfig(), lora).save_checkpoint(checkpoint, step=1, metrics={})
    marker = tmp_path / "pwned"
    torch.save(_Payload(marker), checkpoint / state_file)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        Policy.resume(model, tokenizer, checkpoint, TrainConfig(), lora)
    assert not marker.exists()


# --- imports and registry lookups by a user's string ---------------------------------------------


@pytest.mark.parametrize(
    "name", ["os.system", "training.rewards.python_grader.PythonGrader", "builtins.eval", "__import__"]
)
def test_a_dotted_module_name_is_never_imported_by_a_registry(name):
    with pytest.raises(GraderSpecError, match="must be one of"):
        validate_grader({"type": name})
    with pytest.raises(ConfigError, match="must be one of"):
        validate_environment(name, config={}, tools=[], max_turns=None)
    with pytest.raises(ConfigError, match="unknown tool"):
        validate_environment("python_tools", config={}, tools=[name], max_turns=None)


@pytest.mark.parametrize(
    "text",
    ["{{sample.__class__}}", "{{sample.__init__.__globals__}}", "{{sample.grade}}", "{{__import__}}"],
)
def test_a_grader_template_names_no_attribute_but_the_sample_fields(text):
    with pytest.raises(TemplateSyntaxError, match="unknown variable"):
        Template.parse(text)


@pytest.mark.parametrize(
    "text", ["{{item.__class__}}", "{{sample.output_json.__class__}}", "{{sample.messages.__len__}}"]
)
def test_a_template_path_walks_only_keys_and_indices(text):
    sample = Sample(output_text='{"a": 1}', messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(GradingError) as caught:
        Template.parse(text).render(sample, {"answer": "1"})
    assert caught.value.code == "template_error"


# --- what a client's request may ask of the engine behind the gateway -----------------------------


@pytest.mark.parametrize(
    "name",
    [
        "chat_template",  # a Jinja template of the client's, rendered by vLLM
        "logits_processors",  # vLLM imports these by qualified name
        "guided_regex",
        "guided_grammar",
        "extra_body",
        "lora_request",
        "prompt_logprobs",
    ],
)
def test_engine_only_parameters_are_refused_before_any_engine_sees_them(name):
    with pytest.raises(RequestError) as caught:
        parse_chat_request({"model": "m", "messages": MESSAGES, name: "x"}, Limits.shape_only())
    assert (caught.value.code, caught.value.param) == ("unknown_parameter", name)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://127.0.0.1/"}},
    ],
)
def test_content_parts_an_engine_would_fetch_are_refused(part):
    """vLLM fetches media URLs in content parts: only text parts pass the gateway."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(RequestError) as caught:
        parse_chat_request({"model": "m", "messages": messages}, Limits.shape_only())
    assert (caught.value.code, caught.value.param) == ("unsupported_value", "messages[0].content[1]")


# --- SQL: the demo MCP server's tools take the model's arguments -----------------------------------


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("search_products", {"query_text": "' OR '1'='1"}),
        ("search_products", {"query_text": "x", "category": "lighting' OR '1'='1"}),
        ("search_products", {"query_text": "%'; DROP TABLE products; --"}),
    ],
)
def test_the_demo_mcp_servers_sql_binds_the_models_arguments(tool, arguments):
    from training.environments.mcp_demo.server import build_server

    server = build_server()
    _, structured = asyncio.run(server.call_tool(tool, arguments))
    assert structured == {"result": "[]"}
    _, everything = asyncio.run(server.call_tool("list_categories", {}))
    assert everything["result"] != "[]"  # the table is still there


def test_the_demo_mcp_servers_product_lookup_binds_the_id():
    from mcp.server.fastmcp.exceptions import ToolError

    from training.environments.mcp_demo.server import build_server

    with pytest.raises(ToolError, match="no product with id"):
        asyncio.run(build_server().call_tool("get_product", {"product_id": "P-101' OR '1'='1"}))


# --- outbound headers: a team's header value (MCP config.headers, a judge's API key) ---------------


class _Listener:
    """A loopback socket that records whatever a client sends on its first connection."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/mcp"
        self.received = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.socket.settimeout(5)
        try:
            connection, _ = self.socket.accept()
        except OSError:
            return
        connection.settimeout(0.5)
        with connection, contextlib.suppress(OSError):
            while chunk := connection.recv(65536):
                self.received += chunk


INJECTED = "k\r\nX-Injected: 1"


def test_an_mcp_header_with_a_line_break_is_refused_before_anything_is_sent():
    import httpx

    listener = _Listener()

    async def get() -> None:
        transport = OutboundPolicy(allow=("127.0.0.1",)).httpx_transport()
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            await client.get(listener.url, headers={"Authorization": INJECTED})

    with pytest.raises(httpx.LocalProtocolError, match="Illegal header value"):
        asyncio.run(get())
    listener.socket.close()
    listener.thread.join(5)
    assert b"X-Injected" not in listener.received


def test_a_judge_api_key_with_a_line_break_is_refused_before_anything_is_sent():
    listener = _Listener()
    request = urllib.request.Request(
        listener.url, data=b"{}", headers={"Authorization": f"Bearer {INJECTED}"}
    )
    with pytest.raises(ValueError, match="Invalid header value"):
        OutboundPolicy(allow=("127.0.0.1",)).opener().open(request, timeout=5)
    listener.socket.close()
    listener.thread.join(5)
    assert b"X-Injected" not in listener.received


# --- JSON a model writes: what json.loads cannot hold ----------------------------------------------

LONG_NUMBER = "1" * 5000  # past Python's 4,300-digit int limit: json.loads raises ValueError
DEEP = "[" * 5000  # past the recursion limit: json.loads raises RecursionError


@pytest.mark.parametrize(
    "body",
    ['{"name": "calculator", "arguments": {"expression": ' + LONG_NUMBER, DEEP,
     '{"name": "lookup", "arguments": "' + DEEP + '"}'],
)  # fmt: skip
def test_a_tool_call_the_json_reader_cannot_hold_is_an_invalid_call_not_an_exception(body):
    (call,) = parse_tool_calls(f"<tool_call>{body}")
    assert call.error and call.arguments == {}


# --- the checkpoint archive a team downloads -------------------------------------------------------


def test_an_archived_folder_leaves_out_its_symlinks(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "passwd").symlink_to("/etc/passwd")  # a link entry would point the unpacker at its own file
    for names in (None, ["adapter_config.json", "passwd"]):
        buffer = io.BytesIO()
        write_archive(buffer, folder, names=names, extra={"README.md": "card"})
        buffer.seek(0)
        with tarfile.open(fileobj=buffer, mode="r:gz") as archive:
            members = archive.getmembers()
        assert sorted(member.name for member in members) == ["README.md", "adapter_config.json"]
        assert all(member.isfile() for member in members)
