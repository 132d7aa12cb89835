"""OpenAI's chat completions protocol: request validation and response shapes.

Follows https://platform.openai.com/docs/api-reference/chat so the standard `openai` client works
unchanged. Both the inference server and the gateway validate bodies with `parse_chat_request`
(the gateway to answer 400 without a round trip), so the two can never disagree on what is valid.

Differences from OpenAI, on purpose:
- `logprobs` covers every sampled token, a final end token included, one entry per `token_ids`
  entry, so a client can train on what it sampled. Logprobs (and the `top_logprobs` alternatives,
  up to 20) are those of the distribution the token was sampled from, i.e. after temperature
  (engines/base.py); an engine that cannot report alternatives lists only the sampled token.
- Extension (vLLM's name for it): `"return_token_ids": true` adds `prompt_token_ids` to the
  response and `token_ids` (the sampled completion tokens) to each choice / stream delta.
  `"return_tokens_as_token_ids": true` (vLLM's too) writes each logprob entry's `token` (and its
  alternatives') as `token_id:<id>`, so a client can map logprobs to ids without the tokenizer.
- vLLM's request extensions OpenPipe ART sends or passes on are accepted: `chat_template_kwargs`
  (variables for the chat template, e.g. Qwen3's `enable_thinking`; scalar values, and never one
  of the template call's own arguments), `nvext` (accepted and ignored), and the sampling
  parameters `top_k`, `min_p`, `repetition_penalty`, `frequency_penalty`, `presence_penalty`,
  `logit_bias`. A server applies those its engine honours (`Limits.sampling_extras`: the CPU
  engine does `top_k` and `min_p`; vLLM all of them) and answers 400 naming any other one asked
  for with a non-default value, never ignoring it; the gateway checks only their shape.
- `response_format` `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` are honoured by constrained decoding
  (training.engines.grammar): every token is sampled under a mask of what the grammar allows, and a
  completion whose JSON is complete ends with finish_reason "stop" (one cut short by max_tokens is
  "length", as at OpenAI). The schema is enforced whatever `strict` says, as vLLM does; a schema
  the grammar engine cannot compile is a 400 naming `response_format` with its reason. Logprobs of
  constrained tokens are those of the masked distribution (engines/base.py). It cannot be combined
  with tools (a constrained reply could not call them). `{"type": "text"}` is accepted.
- `tool_choice: "required"` or a named function is honoured by prefilling the start of a Hermes
  `<tool_call>` block; the model writes the rest.
- Streaming sends each token's text as it is sampled (a token that ends inside a character, or
  text that may begin a stop string, is held back until it is settled). A request with tools is
  the exception: a choice may turn out to be a tool call, known only when it ends, so its chunks
  are sent when it is complete.

The protocol is three modules: this one (the wire between gateway and server, request validation),
`responses` (a sampled choice rendered as content or tool calls, whole completion bodies) and
`chunks` (stream chunks and server-sent events). Nothing in them imports torch or Django.

Why one module of this length: every field of OpenAI's chat request and response with its check and
its error, in the one place the inference server and the gateway share.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from training.wire.openai_errors import error_object

# Wire extensions between the gateway and an inference server (never sent to end users).
FETCH_PATH = "/v1/fetch_checkpoint"  # a vLLM host's checkpoint fetcher (training.serving.fetch_server)
ADAPTER_HEADER = "x-artweb-adapter"  # absolute path of the LoRA checkpoint to apply
MODEL_HEADER = "x-artweb-model"  # the public model id to echo in `model`, percent-encoded (RFC 3986)
# A stored checkpoint (projects.storage): its key and content digest; a server given a fetcher
# (ServerConfig.adapter_fetch) resolves them to a verified local copy instead of ADAPTER_HEADER's path.
ADAPTER_KEY_HEADER = "x-artweb-adapter-key"
ADAPTER_SHA256_HEADER = "x-artweb-adapter-sha256"
USAGE_HEADER = "x-artweb-usage"  # "<prompt_tokens> <completion_tokens>" on non-streamed replies
USAGE_COMMENT_PREFIX = b": usage "  # an SSE comment (clients ignore it) carrying the same numbers
DONE_EVENT = b"data: [DONE]\n\n"


def usage_comment(prompt_tokens: int, completion_tokens: int) -> bytes:
    return USAGE_COMMENT_PREFIX + f"{prompt_tokens} {completion_tokens}\n\n".encode()


def parse_usage(value: bytes | str) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a USAGE_HEADER value or a usage comment event."""
    if isinstance(value, bytes):
        if not value.startswith(USAGE_COMMENT_PREFIX):
            return None
        value = value[len(USAGE_COMMENT_PREFIX) :].decode(errors="replace")
    parts = value.split()
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1])


class RequestError(Exception):
    """A request the server will not run; `status`, `code` and `param` go into the error object."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_value", status: int = 400
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        return error_object(self.status, self.message, code=self.code, param=self.param)


@dataclass(frozen=True)
class Limits:
    """What one server accepts. The gateway validates with `Limits.shape_only()`: every server
    applies its own limits again."""

    max_n: int = 16
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when the request gives none
    json_mode: bool = True  # whether response_format json_object / json_schema may be asked for
    # The sampling extensions (SAMPLING_EXTRAS) the engine applies; others with a non-default value
    # are a 400. The CPU engine's sampler (training.engines.sampling) does these two.
    sampling_extras: frozenset[str] = frozenset({"top_k", "min_p"})

    @classmethod
    def shape_only(cls) -> Limits:
        return cls(max_n=128, max_tokens=10**9, json_mode=True, sampling_extras=SAMPLING_EXTRAS)


@dataclass(frozen=True)
class ResponseFormat:
    """A validated `response_format` that asks for JSON (OpenAI's shape, see the module doc)."""

    type: str  # "json_object" | "json_schema"
    schema: dict[str, Any] | None = None  # json_schema's schema; None: any JSON object
    name: str = ""  # json_schema's name
    strict: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # normalised: content is a str; developer -> system
    max_tokens: int
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"name", "description", "parameters"}
    tool_choice: str = "auto"  # "none" | "auto" | "required" | "function"
    tool_choice_name: str | None = None  # set when tool_choice == "function"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None  # None: free text
    return_tokens_as_token_ids: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    top_k: int = 0  # 0: off (vLLM's -1 is read as 0)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tool_prefill(self) -> str:
        """Text appended after the assistant header to force a tool call (see the module doc)."""
        if not self.uses_tools or self.tool_choice == "auto":
            return ""
        if self.tool_choice == "function":
            return '<tool_call>{"name": ' + json.dumps(self.tool_choice_name) + ', "arguments": '
        return '<tool_call>{"name": "'


# Accepted and ignored: they change nothing about what is sampled. `nvext` is NVIDIA Dynamo's
# extension object (OpenPipe ART 0.5.23 sends {"extra_fields": ["engine_data"]}).
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key", "nvext"}
SAMPLING_EXTRAS = frozenset(
    {"top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias"}
)
_KNOWN = {
    "model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "stream", "stream_options",
    "return_token_ids", "response_format", "return_tokens_as_token_ids", "chat_template_kwargs",
} | _IGNORED | SAMPLING_EXTRAS  # fmt: skip
# The chat template call's own arguments (transformers' apply_chat_template): never a template variable.
_TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
}  # fmt: skip
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_TEMPLATE_VARIABLES = 16
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_chat_request(body: Any, limits: Limits) -> ChatRequest:
    """Validate a decoded JSON body; raise RequestError naming the first bad parameter."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                           code="unknown_parameter")  # fmt: skip
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    messages = [_message(raw, index) for index, raw in enumerate(raw_messages)]

    max_tokens = _optional_int(body, "max_completion_tokens", 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1, limits.max_tokens)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be greater than 0", param="top_p")
    n = _optional_int(body, "n", 1, limits.max_n)
    seed = _optional_int(body, "seed", -(2**63), 2**63 - 1)
    logprobs = _bool(body, "logprobs")
    top_logprobs = _optional_int(body, "top_logprobs", 0, 20)
    if top_logprobs and not logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    stream = _bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise RequestError('stream_options must be {"include_usage": true|false}', param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    extras = _sampling_extras(body, limits)
    response_format = _response_format(body.get("response_format"), limits)
    tools = _tools(body.get("tools"))
    tool_choice, tool_choice_name = _tool_choice(body.get("tool_choice"), tools)
    if response_format is not None and tools and tool_choice != "none":
        raise RequestError(f"response_format {response_format.type} cannot be combined with tools",
                           param="response_format", code="unsupported_value")  # fmt: skip
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens if max_tokens is not None else limits.default_max_tokens,
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_name=tool_choice_name,
        n=n if n is not None else 1,
        temperature=temperature,
        top_p=top_p,
        stop=_stop(body.get("stop")),
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
        response_format=response_format,
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids"),
        chat_template_kwargs=_template_variables(body.get("chat_template_kwargs")),
        **extras,
    )


def _sampling_extras(body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """vLLM's sampling extensions, checked for shape; a non-default value the engine cannot apply
    is a 400 naming it (a request is never sampled differently from what it asked)."""
    top_k = _optional_int(body, "top_k", -1, 1_000_000)
    values: dict[str, Any] = {
        "top_k": 0 if top_k in (None, -1) else top_k,
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "logit_bias": _logit_bias(body.get("logit_bias")),
    }
    if values["repetition_penalty"] == 0.0:
        raise RequestError("repetition_penalty must be greater than 0", param="repetition_penalty")
    defaults = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "logit_bias": {}}  # fmt: skip
    for name, value in values.items():
        if value != defaults[name] and name not in limits.sampling_extras:
            raise RequestError(f"{name} is not supported by this server's engine", param=name,
                               code="unsupported_parameter")  # fmt: skip
    return values


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 300:
        raise RequestError("logit_bias must be an object of up to 300 token ids", param="logit_bias")
    bias = {}
    for key, weight in value.items():
        if not isinstance(key, str) or not key.isdecimal() or len(key) > 9:
            raise RequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not -100 <= weight <= 100:
            raise RequestError("logit_bias values must be numbers from -100 to 100", param="logit_bias")
        bias[int(key)] = float(weight)
    return bias


def _template_variables(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_VARIABLES:
        raise RequestError(f"chat_template_kwargs must be an object of up to {MAX_TEMPLATE_VARIABLES} "
                           "variables", param="chat_template_kwargs")  # fmt: skip
    for name, variable in value.items():
        param = f"chat_template_kwargs.{name}"
        if not isinstance(name, str) or not _TEMPLATE_VARIABLE.fullmatch(name):
            raise RequestError(
                "a template variable name is letters, digits and _", param="chat_template_kwargs"
            )
        if name in _TEMPLATE_ARGUMENTS:
            raise RequestError(f"{name} is an argument of the template call, not a template variable",
                               param=param, code="unsupported_parameter")  # fmt: skip
        if variable is not None and not isinstance(variable, str | bool | int | float):
            raise RequestError("template variables must be strings, numbers, booleans or null", param=param)
        if isinstance(variable, str) and len(variable) > 10_000:
            raise RequestError("at most 10000 characters", param=param)
    return dict(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean", param=name)
    return value


def _optional_int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low:g} and {high:g}, got {value}", param=name)
    return float(value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return stops


def _content(value: Any, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError("only text content parts are supported", param=f"{param}[{index}]",
                                   code="unsupported_value")  # fmt: skip
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError("content must be a string or a list of text parts", param=param)


def _message(raw: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise RequestError("each message must be an object", param=param)
    role = raw.get("role")
    if role not in _ROLES:
        raise RequestError(f"role must be one of {', '.join(sorted(_ROLES))}", param=f"{param}.role")
    if raw.get("content") is None and role != "assistant":
        raise RequestError(f"a {role} message needs content", param=f"{param}.content")
    message: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _content(raw.get("content"), f"{param}.content"),
    }
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    if role == "assistant" and raw.get("tool_calls"):
        message["tool_calls"] = _message_tool_calls(raw["tool_calls"], f"{param}.tool_calls")
    if role == "tool":
        if not isinstance(raw.get("tool_call_id"), str):
            raise RequestError("a tool message needs tool_call_id", param=f"{param}.tool_call_id")
        message["tool_call_id"] = raw["tool_call_id"]
    return message


def _message_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise RequestError("tool_calls must be a list", param=param)
    calls = []
    for index, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise RequestError('each tool call needs {"function": {"name": str, "arguments": str}}',
                               param=f"{param}[{index}]")  # fmt: skip
        calls.append(
            {
                "id": str(call.get("id") or f"call_{index}"),
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return calls


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError("tools must be a list", param="tools")
    tools = []
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise RequestError('each tool must be {"type": "function", "function": {"name": ...}}',
                               param=f"tools[{index}]")  # fmt: skip
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise RequestError(
                "parameters must be a JSON schema object", param=f"tools[{index}].function.parameters"
            )
        tools.append(
            {
                "name": str(function["name"]),
                "description": str(function.get("description") or ""),
                "parameters": parameters,
            }
        )
    return tools


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice")  # fmt: skip
    if name not in {tool["name"] for tool in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "function", name


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(value: Any, limits: Limits) -> ResponseFormat | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise RequestError("response_format.type must be text, json_object or json_schema",
                           param="response_format")  # fmt: skip
    if not limits.json_mode:
        raise RequestError(f"response_format {kind} is not supported by this server's engine",
                           param="response_format", code="unsupported_value")  # fmt: skip
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                           param="response_format.json_schema")  # fmt: skip
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise RequestError("json_schema.name must be 1 to 64 letters, digits, underscores or dashes",
                           param="response_format.json_schema.name")  # fmt: skip
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise RequestError("json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")  # fmt: skip
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("json_schema.strict must be a boolean", param="response_format.json_schema.strict")
    return ResponseFormat("json_schema", schema=schema, name=name, strict=bool(strict))
