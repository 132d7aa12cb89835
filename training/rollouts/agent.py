"""Rollouts, through the agent loop: model turn, environment reply, ..., final answer; task rows
in, trajectories (`training/rollouts/trajectory.py`: messages, exact tokens, a trainable-token mask) out,
many at once. A single-turn rollout is this loop with one turn and no tools: one code path for both.

The loop drives any environment through its message-level protocol (`training/environments/base.py`):
`start(row)` gives the prompt messages, `respond_batch` answers each model turn with tool messages
(tool environments) or a user message (games: the board after the opponent's move), and says when
the episode is over; `outcome(state)` is what the episode achieved, kept on the trajectory.

Token exactness, the invariant this module keeps: a trajectory's tokens are the rendered prompt,
then for each model turn the EXACT ids the engine sampled (mask 1, with their logprobs), then the
environment's ids (mask 0): the end of the turn as the chat template writes it, the environment's
messages, the next assistant header. The next turn is generated from exactly these ids. The model's
own text is never re-rendered and re-tokenised: a text has many tokenisations, and the trainer must
score the tokens that were sampled, not another tokenisation of the same text.

All trajectories of a step advance in lockstep: one batched engine call per turn for every
trajectory still running, then one `respond_batch` for all of them (their tool calls run at once).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Any

from training.engines.base import Choice, Engine, SamplingParams, render_chat
from training.environments.base import Environment, EpisodeState
from training.rollouts.strict_json import loads_lenient
from training.rollouts.tools import Tool, ToolCall, parse_tool_calls, tools_prompt, written_calls
from training.rollouts.trajectory import Trajectory


class ChatTemplateError(RuntimeError):
    """The chat template cannot be continued token by token (see `ChatFormat.environment_ids`)."""


@dataclass(frozen=True)
class RolloutProgress:
    """Where a batch of rollouts stands, for progress reports: the current model turn, how many of
    the trajectories still running at its start have finished generating it, and how many groups
    (rows) have every trajectory over. Reported when a trajectory finishes its turn and at the end
    of each turn, never per token."""

    turn: int
    max_turns: int
    finished_in_turn: int
    running_in_turn: int
    groups_done: int
    groups: int


OnProgress = Callable[[RolloutProgress], None]


def rollout_group(
    engine: Engine,
    row: dict,
    env: Environment,
    sampling: SamplingParams,
    group_size: int,
    adapter: str | None = None,
) -> list[Trajectory]:
    """`group_size` trajectories for one task row."""
    return rollout_groups(engine, [row], env, sampling, group_size, adapter=adapter)[0]


def rollout_groups(
    engine: Engine,
    rows: list[dict],
    env: Environment,
    sampling: SamplingParams,
    group_size: int,
    adapter: str | None = None,
    *,
    on_progress: OnProgress | None = None,
) -> list[list[Trajectory]]:
    """`group_size` trajectories for each row, in row order.

    Each runs up to `env.max_turns` model turns and ends earlier when the environment says so: for
    tool environments at a turn without a tool call (the final answer), for games at game over.
    With no tools and no game, every turn is a final answer: a plain single-turn rollout. On the
    last allowed turn the environment's reply is not shown to the model (no turn is left to read
    it): a tool environment does not run that turn's calls; a game still plays the move.
    `on_progress` hears a RolloutProgress as trajectories finish (see RolloutProgress).

    A row's own `tools` (OpenAI function definitions, as a fine-tuning file's rows carry them) are
    offered beside the environment's and their calls parsed; the environment runs what it can (a
    call of a tool it does not have gets an error result). With the row's `parallel_tool_calls`
    false, only a turn's first call is kept: the later ones stay in the turn's text (its sampled
    tokens are trained as sampled) but are not run, not in the message's `tool_calls` and not in
    the graders' `output_tools`.
    """
    tools = list(env.tools)
    formats: dict[str, ChatFormat] = {}  # one per distinct set of row tools (its template probe)
    episodes: list[_Episode] = []
    for row_position, row in enumerate(rows):
        definitions = row.get("tools") or []
        key = json.dumps(definitions, sort_keys=True)
        chat = formats.get(key) or formats.setdefault(key, ChatFormat(engine, tools, definitions))
        for sample_index in range(group_size):
            state = env.start(row, seed=episode_seed(sampling.seed, row_position, sample_index))
            messages = chat.prompt_messages(state.messages)
            ids = chat.render(messages, add_generation_prompt=True)
            episodes.append(
                _Episode(state, messages, ids, chat=chat, one_call=row.get("parallel_tool_calls") is False)
            )

    for turn in range(1, env.max_turns + 1):
        active = [episode for episode in episodes if not episode.done]
        if not active:
            break
        report = _progress_reporter(on_progress, episodes, group_size, turn, env.max_turns, len(active))
        prompts, turn_sampling = [e.token_ids for e in active], _turn_sampling(sampling, turn)
        if report is None:
            choices = engine.generate_from_tokens(prompts, turn_sampling, adapter=adapter)
        else:
            choices = engine.generate_from_tokens(prompts, turn_sampling, adapter=adapter, on_finished=report)
        calls = [episode.calls(choice.text, turn) for episode, choice in zip(active, choices, strict=True)]
        for episode, choice, episode_calls in zip(active, choices, calls, strict=True):
            episode.add_model_turn(choice, episode_calls)
        replies = env.respond_batch([e.state for e in active], [c.text for c in choices], calls)
        for episode, choice, reply in zip(active, choices, replies, strict=True):
            if reply.done:
                episode.finish(reply.finish_reason or choice.finish_reason)
            else:
                env_ids = episode.chat.environment_ids(
                    episode.messages, reply.messages, episode.last_sampled_ids
                )
                episode.add_environment_turn(reply.messages, env_ids)
        if report:
            report(None)  # the turn is over: groups whose every episode is done now count as done

    trajectories = [episode.to_trajectory(env.outcome(episode.state)) for episode in episodes]
    return [trajectories[i * group_size : (i + 1) * group_size] for i in range(len(rows))]


def _progress_reporter(
    on_progress: OnProgress | None,
    episodes: list[_Episode],
    group_size: int,
    turn: int,
    max_turns: int,
    running: int,
) -> Callable[[int | None], None] | None:
    """The engine's `on_finished` callback for one turn (a row index of the turn's batch), also
    called with None once the turn's replies are in."""
    if on_progress is None:
        return None
    groups = len(episodes) // group_size
    finished = 0

    def report(row: int | None) -> None:
        nonlocal finished
        if row is not None:
            finished += 1
        done = sum(
            all(e.done for e in episodes[g * group_size : (g + 1) * group_size]) for g in range(groups)
        )
        on_progress(RolloutProgress(turn, max_turns, finished, running, done, groups))

    return report


def episode_seed(seed: int | None, row_position: int, sample_index: int) -> int | None:
    """The environment's seed for one trajectory (a game's opponent, its new tiles): fixed by the
    rollout's seed, so a resumed step replays the same games. A row's `item.seed`, when given,
    takes precedence (see the game environments)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + row_position * 9_973 + sample_index) % (2**63)


def _turn_sampling(sampling: SamplingParams, turn: int) -> SamplingParams:
    """A seeded rollout draws other random numbers on each turn: reusing the first turn's would
    correlate the turns' samples. Turn 1 keeps the seed, so single-turn rollouts are unchanged."""
    if sampling.seed is None or turn == 1:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + 7919 * (turn - 1))


@dataclass
class _Episode:
    """One trajectory while it is being generated: the environment's state, the transcript, tokens."""

    state: EpisodeState
    messages: list[dict]
    prompt_token_ids: list[int]
    chat: ChatFormat
    one_call: bool = False  # the row's parallel_tool_calls is false
    completion_token_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_sampled_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    done: bool = False
    turns: int = 0
    tool_calls: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.completion_token_ids

    def calls(self, text: str, turn: int) -> list[ToolCall]:
        """The calls of a model turn, when tools are offered (only the first with `one_call`)."""
        if not self.chat.offers_tools:
            return []
        calls = parse_tool_calls(text, id_prefix=f"call_{turn}_")
        return calls[:1] if self.one_call else calls

    def add_model_turn(self, choice: Choice, calls: list[ToolCall]) -> None:
        self.completion_token_ids += choice.token_ids
        self.completion_mask += [1] * len(choice.token_ids)
        self.logprobs += choice.logprobs
        self.last_sampled_ids = list(choice.token_ids)
        # The content is the model's text, tool-call blocks included: what it wrote, for the viewer
        # and the graders. `tool_calls` holds the same calls parsed, OpenAI-style.
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        self.messages.append(message)
        self.turns += 1
        self.tool_calls += len(calls)

    def add_environment_turn(self, replies: list[dict], token_ids: list[int]) -> None:
        self.messages += replies
        self.completion_token_ids += token_ids
        self.completion_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.done = True

    def to_trajectory(self, outcome: dict[str, Any]) -> Trajectory:
        return Trajectory(
            messages=self.messages,
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=self.completion_token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            completion_mask=self.completion_mask,
            metrics={"turns": self.turns, "tool_calls": self.tool_calls, **self.state.metrics},
            outcome=dict(outcome),
        )


class ChatFormat:
    """How one engine's chat template shows the tools, renders conversations, and what it puts
    between two model turns.

    A template that takes `tools=` (rendering with tools changes its output) gets them in its own
    format; otherwise the tools are described in the system prompt (`tools_system_prompt`). The
    model calls them in the Hermes `<tool_call>` format either way (`training/rollouts/tools.py`).
    The tools offered are the environment's and `definitions`, a task row's own (OpenAI's).
    """

    def __init__(
        self, engine: Engine, tools: list[Tool], definitions: list[dict[str, Any]] | None = None
    ) -> None:
        self.tokenizer = engine.tokenizer
        self.tools = tools
        own = {tool.name for tool in tools}  # a row's tool of the same name is the environment's
        rows = [d for d in definitions or [] if d.get("function", {}).get("name") not in own]
        self.definitions = [tool.schema() for tool in tools] + rows
        self.offers_tools = bool(self.definitions)
        self.native_tools = self.offers_tools and template_supports_tools(self.tokenizer)
        self.tool_schemas = self.definitions if self.native_tools else None
        eos = self.tokenizer.eos_token_id
        self.turn_end_ids: Set[int] = set(engine.stop_token_ids) | ({int(eos)} if eos is not None else set())

    def prompt_messages(self, messages: list[dict]) -> list[dict]:
        """The first prompt: the task's messages, with the tools described in the system prompt
        when the template cannot show them itself (`offer_tools`)."""
        return offer_tools(messages, self.definitions, native=self.native_tools)

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
        return render_chat(
            self.tokenizer,
            for_template(messages),
            tools=self.tool_schemas,
            add_generation_prompt=add_generation_prompt,
        )

    def environment_ids(
        self, conversation: list[dict], new_messages: list[dict], sampled_ids: list[int]
    ) -> list[int]:
        """The ids that follow a model turn's sampled ids (the conversation ends with that turn's
        assistant message): the rest of the turn's end, `new_messages`, the next assistant header.

        They are the token suffix of the rendered conversation + new messages after the rendered
        conversation, when the template renders the conversation the same way once it goes on.
        Some templates render the last assistant turn differently once it is no longer last (Qwen3
        adds an empty think block to the last one only); then everything before that turn must
        still match, and the suffix is taken after the end token that closes it.
        """
        with_turn = self.render(conversation, add_generation_prompt=False)
        continued = self.render(conversation + new_messages, add_generation_prompt=True)
        if continued[: len(with_turn)] == with_turn:
            tail = _closing(with_turn, self.turn_end_ids) + continued[len(with_turn) :]
        else:
            tail = self._tail_after_rerendered_turn(conversation, continued)
        # The template ends an assistant turn with an end token and maybe more ("<|im_end|>\n").
        # A model that stopped by sampling an end token wrote the first part itself; one cut off
        # by max_new_tokens or a stop string did not, and the environment closes its turn.
        if tail and tail[0] in self.turn_end_ids and sampled_ids and sampled_ids[-1] in self.turn_end_ids:
            tail = tail[1:]
        return tail

    def _tail_after_rerendered_turn(self, conversation: list[dict], continued: list[int]) -> list[int]:
        prompt = self.render(conversation[:-1], add_generation_prompt=True)
        if continued[: len(prompt)] != prompt:
            raise ChatTemplateError(
                "the chat template renders the conversation before the model's last turn "
                "differently once messages are added to it, so the tokens between model turns "
                "cannot be derived from it"
            )
        for index in range(len(prompt), len(continued)):
            if continued[index] in self.turn_end_ids:
                return continued[index:]
        raise ChatTemplateError("the chat template does not close the model's turn with an end token")


def offer_tools(messages: list[dict], definitions: list[dict[str, Any]], *, native: bool) -> list[dict]:
    """A conversation as it is given to a chat template that shows tools (`native`: as it is; the
    template gets `definitions` as `tools=` and renders tool calls itself) or that does not: the
    tools described in the system prompt, and each assistant message's tool calls written into its
    content as the model writes them (`written_calls`). The SFT recipe renders a row's targets so,
    and a rollout its prompt, so that a model is taught the calls it is later asked to make."""
    if native:
        return messages
    messages = [
        {key: value for key, value in m.items() if key != "tool_calls"}
        | {"content": written_calls(m.get("content") or "", m["tool_calls"])}
        if m.get("tool_calls")
        else m
        for m in messages
    ]
    if not definitions:
        return messages
    block = tools_prompt(definitions)
    if messages and messages[0]["role"] == "system":
        system = messages[0].get("content") or ""
        return [{**messages[0], "content": f"{system}\n\n{block}" if system else block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows `tools=`: rendering with a tool changes its output."""
    probe = [{"role": "user", "content": "Hi"}]
    tool = Tool("probe", "A probe.", {"type": "object", "properties": {}}, lambda: None).schema()
    try:
        return render_chat(tokenizer, probe, tools=[tool]) != render_chat(tokenizer, probe)
    except Exception:  # a template that breaks on tools does not support them
        return False


def _closing(rendered_ids: list[int], turn_end_ids: Set[int]) -> list[int]:
    """How the template closes the last turn of a rendered conversation: from its last end token
    on ([] for a template that writes no end token)."""
    for index in range(len(rendered_ids) - 1, -1, -1):
        if rendered_ids[index] in turn_end_ids:
            return rendered_ids[index:]
    return []


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face chat templates expect them: tool-call arguments as objects, not the
    JSON strings of OpenAI's format; content never None; no training `weight`."""
    rendered = []
    for message in messages:
        message = {key: value for key, value in message.items() if key != "weight"}
        message["content"] = message.get("content") or ""
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]
            ]
        rendered.append(message)
    return rendered


def _loads(arguments: str) -> Any:
    try:
        return loads_lenient(arguments)
    except json.JSONDecodeError:
        return arguments
