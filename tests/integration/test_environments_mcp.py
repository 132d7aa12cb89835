"""The mcp environment against the shipped demo server (training/environments/mcp_demo), over stdio
and over streamable HTTP, driven by the agent loop; and a tool that hangs, cut off by its timeout.

No database or broker: these tests start only MCP server processes on this machine."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.openai_stub import LOOPBACK
from training.engines.base import Choice, Engine, SamplingParams
from training.environments import build_environment
from training.environments.mcp import DEMO_MODULE, StdioPolicy
from training.rollouts.agent import rollout_groups

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = SamplingParams(max_new_tokens=64, seed=0)
STDIO = {"command": ["python", "-m", DEMO_MODULE]}


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptEngine(Engine):
    """Replies the script's k-th entry on the k-th model turn (one episode)."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer = tokenizer
        self.script = iter(script)
        self.prompts: list[list[int]] = []

    def generate_from_tokens(self, prompt_token_ids, sampling, adapter=None):
        choices = []
        for prompt in prompt_token_ids:
            self.prompts.append(list(prompt))
            text = next(self.script)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            choices.append(Choice(text, list(prompt), ids, [-0.1] * len(ids), finish_reason="stop"))
        return choices

    def load_adapter(self, name, path):
        raise NotImplementedError

    def unload_adapter(self, name):
        raise NotImplementedError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from training.base_models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def http_server(tmp_path):
    port = free_port()
    with serving([sys.executable, "-m", DEMO_MODULE, "--http", "--port", str(port)], port, tmp_path):
        yield f"http://127.0.0.1:{port}/mcp"


@contextlib.contextmanager
def serving(command: list[str], port: int, tmp_path: Path):
    """Runs an HTTP server process until the block ends; enters the block once it listens."""
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("the MCP server did not start listening")
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)


def run_product_episode(tokenizer, config: dict):
    script = [
        call("search_products", query_text="Lamp", max_price=50) + call("get_product", product_id="P-999"),
        call("get_product", product_id="P-101"),
        "The Aurora Desk Lamp costs 34.5 and 12 are in stock.",
    ]
    engine = ScriptEngine(tokenizer, script)
    with build_environment("mcp", config=config, max_turns=4, tool_timeout_s=10, outbound=LOOPBACK) as env:
        assert [tool.name for tool in env.tools] == ["search_products", "get_product", "list_categories"]
        assert env.tools[1].parameters["required"] == ["product_id"]
        row = {"prompt": "How much is the cheapest lamp, and how many are in stock?", "item": {"id": "P-101"}}
        ((trajectory,),) = rollout_groups(engine, [row], env, SAMPLING, group_size=1)
    return engine, trajectory


def check_product_episode(engine, trajectory, tokenizer) -> None:
    assert [m["role"] for m in trajectory.messages] == [
        "system", "user", "assistant", "tool", "tool", "assistant", "tool", "assistant"
    ]  # fmt: skip
    # The tools are shown to the model in the system prompt (the tiny model's template has no tools).
    assert '"name": "get_product"' in trajectory.messages[0]["content"]
    found, missing, product = (m["content"] for m in trajectory.messages if m["role"] == "tool")
    assert json.loads(found) == [
        {"id": "P-101", "name": "Aurora Desk Lamp", "category": "lighting", "price": 34.5}
    ]
    assert "no product with id 'P-999'" in json.loads(missing)["error"]  # a server error, read by the model
    assert json.loads(product)["stock"] == 12
    assert trajectory.metrics == {"turns": 3, "tool_calls": 3, "tool_errors": 1, "tool_timeouts": 0}
    assert trajectory.output_tools[-1] == {"name": "get_product", "arguments": {"product_id": "P-101"}}
    # Token exactness over the three turns: the environment's ids are mask 0, the model's mask 1.
    text = tokenizer.decode(trajectory.prompt_token_ids + trajectory.completion_token_ids)
    assert text + "\n" == tokenizer.apply_chat_template(trajectory.messages, tokenize=False)
    everything = trajectory.prompt_token_ids + trajectory.completion_token_ids
    assert engine.prompts[-1] == everything[: len(engine.prompts[-1])]  # the last turn continued them
    assert sum(trajectory.completion_mask) == sum(
        len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) + 1
        for m in trajectory.messages
        if m["role"] == "assistant"
    )


def test_mcp_environment_over_stdio(tokenizer):
    engine, trajectory = run_product_episode(tokenizer, STDIO)
    check_product_episode(engine, trajectory, tokenizer)


def test_mcp_environment_over_streamable_http(tokenizer, http_server):
    engine, trajectory = run_product_episode(tokenizer, {"url": http_server})
    check_product_episode(engine, trajectory, tokenizer)


def test_only_the_named_tools_are_exposed_and_unknown_names_fail_at_start():
    with build_environment("mcp", config=STDIO, tools=["get_product"]) as env:
        assert [tool.name for tool in env.tools] == ["get_product"]
    env = build_environment("mcp", config=STDIO, tools=["get_weather"])
    with pytest.raises(
        RuntimeError, match=r"no tool get_weather \(it has: get_product, list_categories, search_products\)"
    ):
        env.open()
    env.close()


def test_an_unreachable_server_is_a_clear_error():
    env = build_environment(
        "mcp",
        config={"url": f"http://127.0.0.1:{free_port()}/mcp", "connect_timeout_s": 5},
        outbound=LOOPBACK,
    )
    with pytest.raises(RuntimeError, match="MCP server"):
        env.open()


def test_a_hanging_tool_is_cut_off_by_its_timeout_and_the_trajectory_records_it(tokenizer, tmp_path):
    server = tmp_path / "hang_server.py"
    server.write_text(
        textwrap.dedent(
            """
            import anyio
            from mcp.server.fastmcp import FastMCP

            server = FastMCP("hang", log_level="WARNING")

            @server.tool()
            async def hang(seconds: float) -> str:
                \"\"\"Never answers in time (the server itself stays responsive).\"\"\"
                await anyio.sleep(seconds)
                return "woke up"

            @server.tool()
            def echo(text: str) -> str:
                \"\"\"Echoes.\"\"\"
                return text

            server.run("stdio")
            """
        )
    )
    env = build_environment(
        "mcp",
        config={"command": [sys.executable, str(server)]},
        max_turns=3,
        tool_timeout_s=1.0,
        stdio=StdioPolicy(commands=(f"{sys.executable} {server}",)),
    )
    engine = ScriptEngine(tokenizer, [call("hang", seconds=30) + call("echo", text="hi"), "It timed out."])
    started = time.monotonic()
    with env:
        ((trajectory,),) = rollout_groups(engine, [{"prompt": "Wait."}], env, SAMPLING, group_size=1)
        # The session still works after the timeout.
        assert env.tools[1].function(text="again") == "again"
    assert time.monotonic() - started < 20
    hang_result, echo_result = (m["content"] for m in trajectory.messages if m["role"] == "tool")
    assert json.loads(hang_result) == {"error": "tool 'hang' did not finish within 1 s"}
    assert echo_result == "hi"
    assert trajectory.metrics == {"turns": 2, "tool_calls": 2, "tool_errors": 0, "tool_timeouts": 1}
    assert trajectory.output_text == "It timed out."


def test_a_run_lists_the_servers_tools_at_start_and_closes_the_session_at_the_end(tmp_path):
    from training.base_models import build_tiny_model
    from training.config import LoraSpec, TrainConfig
    from training.runs.loop import run_training
    from training.runs.spec import RunSpec

    environment = build_environment("mcp", config=STDIO, max_turns=2)
    events: list[str] = []
    steps: list[list] = []

    class Hooks:
        def should_stop(self):
            return None

        def record_checkpoint(self, **kwargs):
            pass

        def record_step(self, *, step, metrics, trajectories, path):
            steps.append(trajectories)
            return True

        def event(self, message, **kwargs):
            events.append(message)

        def record_evaluation(self, **kwargs):
            pass

    spec = RunSpec.resolving(
        base_model_source=str(build_tiny_model(tmp_path / "tiny", seed=0)),
        model_cache_dir=tmp_path / "cache",
        checkpoint_root=tmp_path / "checkpoints",
        config=TrainConfig.from_dict(
            {"steps": 1, "groups_per_step": 1, "group_size": 2, "max_new_tokens": 6}
        ),
        lora=LoraSpec.from_dict({"rank": 4, "alpha": 8}),
        environment=environment,
        grader_spec={"type": "tool_call", "tool": "get_product"},
        train_rows=[{"index": 0, "data": {"prompt": "Price of P-101?"}}],
        start_step=0,
        resume_step=None,
    )
    assert run_training(spec, Hooks()) == "succeeded"
    assert "Environment tools: search_products, get_product, list_categories" in events
    assert len(steps) == 1 and all("get_product" in t.messages[0]["content"] for _, _, t in steps[0])
    assert environment._session is None  # closed with the run


def test_stored_headers_reach_the_http_server_decrypted(tmp_path):
    """What the API stores (header values encrypted) is what the worker sends, in plaintext."""
    from projects.environment_config import config_for_build, config_for_storage

    server = tmp_path / "whoami_server.py"
    server.write_text(
        textwrap.dedent(
            """
            import sys
            from mcp.server.fastmcp import Context, FastMCP

            server = FastMCP("whoami", host="127.0.0.1", port=int(sys.argv[1]), log_level="WARNING")

            @server.tool()
            def whoami(ctx: Context) -> str:
                \"\"\"The Authorization header this request came with.\"\"\"
                return ctx.request_context.request.headers.get("authorization", "none")

            server.run("streamable-http")
            """
        )
    )
    port = free_port()
    stored = config_for_storage(
        {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"Authorization": "Bearer t0ken"}}
    )
    assert "t0ken" not in json.dumps(stored)
    with (
        serving([sys.executable, str(server), str(port)], port, tmp_path),
        build_environment("mcp", config=config_for_build(stored), outbound=LOOPBACK) as env,
    ):
        assert env.tools[0].function() == "Bearer t0ken"
