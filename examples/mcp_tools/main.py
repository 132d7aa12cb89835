"""MCP tool use: the client lists the tools of artweb's MCP demo server over stdio, makes scenarios
from that list, asks the model to call the right tool, runs the call over MCP and scores it.

    .venv-art/bin/python examples/mcp_tools/main.py --steps 10 --base-url http://127.0.0.1:8000/v1 --api-key aw_...

Scenarios come from the tool list alone: each tool's description plus argument values drawn for its
input schema (from the demo's product data, where a property is an id, a category or a price).
Reward: 0.4 for calling the scenario's tool, up to 0.4 for its arguments (the share given exactly),
0.2 when the call then runs on the MCP server without error. A parsed call of another name earns up
to 0.2 by the name's likeness to the right one (the bundled 135M model invents tool names often, and
GRPO needs rewards that differ), and so does a malformed call whose text still names a tool.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  (first: it sets ART's environment)
from common import art  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "training" / "environments" / "mcp_demo"
SYSTEM = "You are a shop assistant. Answer every request by calling one of these tools: {names}."


def value_pool() -> dict[str, list[Any]]:
    """Argument values a scenario may ask for, from the demo's own data file."""
    products = json.loads((DEMO / "products.json").read_text())
    return {
        "id": [p["id"] for p in products],
        "category": sorted({p["category"] for p in products}),
        "price": [25, 50, 100, 150],
        "word": sorted({word.lower() for p in products for word in p["name"].split()}),
    }


def draw(name: str, schema: dict[str, Any], pool: dict[str, list[Any]], rng: random.Random) -> Any:
    kinds = {schema.get("type")} | {option.get("type") for option in schema.get("anyOf", [])}
    if "id" in name:
        return rng.choice(pool["id"])
    if "category" in name:
        return rng.choice(pool["category"])
    if kinds & {"number", "integer"}:
        return rng.choice(pool["price"])
    return rng.choice(pool["word"])


def scenarios_from(tools: list[Any], count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` requests: a tool, the arguments to give it, and the request text naming them."""
    rng, pool, made = random.Random(seed), value_pool(), []
    for index in range(count):
        tool = tools[index % len(tools)]
        properties = tool.inputSchema.get("properties", {})
        required = set(tool.inputSchema.get("required", []))
        chosen = [name for name in properties if name in required or rng.random() < 0.5]
        arguments = {name: draw(name, properties[name], pool, rng) for name in chosen}
        summary = (tool.description or tool.name).strip().split("\n")[0]
        asked = ", ".join(f"{name} = {value}" for name, value in arguments.items())
        request = f"{summary} {'With ' + asked + '.' if asked else ''}".strip()
        made.append({"tool": tool.name, "arguments": arguments, "request": request})
    rng.shuffle(made)
    return made


def argument_share(expected: dict[str, Any], given: dict[str, Any]) -> float:
    if not expected:
        return 1.0 if not given else 0.5
    same = sum(
        str(given.get(name, "")).strip().lower() == str(value).lower() for name, value in expected.items()
    )
    return same / len(expected)


def likeness(name: str, wanted: str) -> float:
    return difflib.SequenceMatcher(None, name, wanted).ratio()


def make_rollout(session: ClientSession, tools: list[dict[str, Any]], max_tokens: int) -> common.Rollout:
    async def rollout(
        model: art.TrainableModel, scenario: dict[str, Any], temperature: float
    ) -> art.Trajectory:
        system = SYSTEM.format(names=", ".join(tool["function"]["name"] for tool in tools))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": scenario["request"]}]
        choice = await common.sample(model, messages, max_tokens=max_tokens, temperature=temperature,
                                     tools=tools, tool_choice="required")  # fmt: skip
        trajectory = art.Trajectory(messages_and_choices=[*messages, choice], tools=tools, reward=0.0,
                                    metadata={"tool": scenario["tool"]})  # fmt: skip
        calls = choice.message.tool_calls or []
        if not calls:  # a malformed call: credit for the name it wrote, if any
            named = re.search(r'"name":\s*"([^"]*)', choice.message.content or "")
            trajectory.reward = 0.2 * likeness(named.group(1), scenario["tool"]) if named else 0.0
            return trajectory
        call = calls[0].function
        try:
            given = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            given = None
        if call.name != scenario["tool"]:
            trajectory.reward = 0.2 * likeness(call.name, scenario["tool"])
            return trajectory
        trajectory.reward = 0.4
        if isinstance(given, dict):
            trajectory.reward += 0.4 * argument_share(scenario["arguments"], given)
            result = await session.call_tool(call.name, given)
            trajectory.metrics["tool_error"] = float(result.isError)
            trajectory.reward += 0.0 if result.isError else 0.2
        return trajectory

    return rollout


async def run(args: Any) -> None:
    server = StdioServerParameters(command=sys.executable, args=[str(DEMO / "server.py")])
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = (await session.list_tools()).tools
        print("MCP tools:", ", ".join(tool.name for tool in listed))
        tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.inputSchema}}
            for t in listed
        ]  # fmt: skip
        pool = scenarios_from(listed, 60 + args.eval_rows, seed=args.seed)
        held_out, training = pool[: args.eval_rows], pool[args.eval_rows :]

        def train_scenarios(step: int) -> list[dict[str, Any]]:
            return [training[(step * args.groups + group) % len(training)] for group in range(args.groups)]

        rollout = make_rollout(session, tools, args.max_tokens)
        await common.train(args, rollout=rollout, train_scenarios=train_scenarios, held_out=held_out)


def main() -> None:
    flags = common.parser(__doc__.splitlines()[0], model="mcp-tools")
    flags.set_defaults(max_tokens=40)
    asyncio.run(run(flags.parse_args()))


if __name__ == "__main__":
    main()
