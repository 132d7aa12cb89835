"""`chat`: one model turn, no tools; the reply is the final answer. The simplest environment."""

from __future__ import annotations

from typing import Any, ClassVar

from training.environments.base import ConfigError, Environment, _object


class ChatEnvironment(Environment):
    kind: ClassVar[str] = "chat"
    description: ClassVar[str] = "A single model turn answering the task row's prompt; no tools."
    answer: ClassVar[str] = "the model's reply (output_text)"
    default_max_turns: ClassVar[int] = 1

    @classmethod
    def validate(cls, config: Any, tools: Any, max_turns: int | None) -> dict[str, Any]:
        config = _object(config, "config")
        if config:
            raise ConfigError(f"config.{next(iter(config))}", "unknown key (chat takes no config)")
        if tools not in (None, []):
            raise ConfigError("tools", "a chat environment takes no tools (use python_tools or mcp)")
        if max_turns not in (None, 1):
            raise ConfigError("max_turns", "a chat environment has exactly one turn")
        return {"config": {}, "tools": [], "max_turns": 1}
