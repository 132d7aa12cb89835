"""Render a chat request to prompt token ids with the model's chat template.

Tools are shown the way the agent loop shows them (training.rollouts.agent.ChatFormat), so a checkpoint is
served with the prompts it was trained on: a template that takes `tools=` gets them natively;
otherwise they are described in the system prompt (`training.rollouts.tools.tools_system_prompt`) and an
earlier assistant turn's `tool_calls` are written back as the Hermes `<tool_call>` text the model
produced. Tool result messages go to the template as `role: tool` messages.
"""

from __future__ import annotations

import json
from typing import Any

from training.engines.base import render_chat
from training.rollouts.strict_json import loads_lenient
from training.rollouts.tools import Tool, tools_system_prompt, written_calls
from training.serving.protocol import ChatRequest, RequestError


def render_prompt(tokenizer: Any, request: ChatRequest, *, native_tools: bool) -> list[int]:
    """Prompt token ids, ending with the assistant header (and any tool-call prefill)."""
    messages = [dict(message) for message in request.messages]
    schemas = None
    if request.uses_tools:
        if native_tools:
            schemas = [{"type": "function", "function": tool} for tool in request.tools]
        else:
            block = tools_system_prompt([_as_tool(tool) for tool in request.tools])
            if messages[0]["role"] == "system":
                system = messages[0]["content"]
                messages[0]["content"] = f"{system}\n\n{block}" if system else block
            else:
                messages.insert(0, {"role": "system", "content": block})
    for message in messages:
        calls = message.pop("tool_calls", None)
        if not calls:
            continue
        if native_tools:
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _loads(call["function"]["arguments"])}}
                for call in calls
            ]
        else:
            message["content"] = written_calls(message["content"], calls)
    try:
        ids = render_chat(tokenizer, messages, tools=schemas, variables=request.chat_template_kwargs)
    except Exception as exc:  # jinja raises whatever the template author chose
        raise RequestError(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from exc
    prefill = request.tool_prefill()
    if prefill:
        ids += list(tokenizer(prefill, add_special_tokens=False)["input_ids"])
    return ids


def _as_tool(schema: dict[str, Any]) -> Tool:
    return Tool(schema["name"], schema["description"], schema["parameters"], function=_not_callable)


def _not_callable(**arguments: Any) -> None:
    raise RuntimeError("served tools are run by the client, not the server")


def _loads(arguments: str) -> Any:
    try:
        return loads_lenient(arguments)
    except json.JSONDecodeError:
        return arguments
