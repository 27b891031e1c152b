"""One agent episode: the conversation an agent program holds through its endpoint, kept as the trainer needs it.

An agent sends its whole conversation with every call. The first call's rendering is the trajectory's prompt.
A later call that repeats the conversation so far (with the assistant replies as this endpoint returned them, or
as their plain text) and adds messages after the last reply continues the same token sequence: the reply keeps
the ids the generator sampled, and only what the chat template puts after it (the end of the turn, the new
tool results and user messages, the next generation prompt) is tokenized (`ChatRenderer.continuation`).
A call whose conversation does not continue the last one (the agent dropped or rewrote earlier turns) starts
a fresh sequence, which the trainer trains on its own with the episode's advantage, as `context: template`
turns are (`Trajectory.segments`). So every generated token reaches the trainer exactly as sampled, with its
behaviour log-prob and weight version, whatever the agent does with the text.

Calls of one episode are served one at a time, in the order they arrive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from rollart.agents.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls
from rollart.errors import RollartError
from rollart.protocol.messages import Generate, Generated
from rollart.rollout.config import SamplingSpec, TaskSpec
from rollart.rollout.render import THINK_END, ChatRenderer
from rollart.rollout.turns import TurnHistory, turn_request

Generator = Callable[[Generate], Awaitable[Generated]]
Normal = tuple[str, str, str, str, str]
"""A message as compared between calls: role, text, tool calls (canonical JSON), tool_call_id, name."""
ROLES = ("system", "developer", "user", "assistant", "tool")


class AgentCallError(RollartError):
    """A call the endpoint refuses: `status` is its HTTP status, `code` OpenAI's error code."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code = status, code
        self.extra = extra
        """More fields for the error object of the response."""


class EpisodeClosed(AgentCallError):
    """The episode ended (finished, cancelled as a redundant extra, too stale): no more calls."""

    def __init__(self, episode_id: str, reason: str) -> None:
        super().__init__(409, "episode_closed", f"episode {episode_id} is closed: {reason}")


class EpisodeReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """An agent program's own account of its episode (`POST <base_url>/rollart/report`)."""

    reward: float | None = None
    """The episode's reward (with the task's `reward: report`); None: none given."""
    success: bool = False
    answer: str | None = None
    """The agent's final answer, for a reward function that scores it (`reward: gateway`)."""


@dataclass(frozen=True)
class Reply:
    """One generated turn as an agent sees it, with what the generator returned."""

    text: str
    """The reply's text after its thinking (what tool calls are parsed from)."""
    reasoning: str | None
    """The thinking, when the model thought (`<think>...</think>`)."""
    content: str | None
    tool_calls: list[ToolCall]
    tool_error: MalformedToolCall | None
    """Why the reply's tool calls could not be parsed; None when they could (or there were none)."""
    generated: Generated
    turn: int


class AgentEpisode:
    """An episode's tokens and conversation, and the generation of each of its turns."""

    def __init__(
        self,
        episode_id: str,
        *,
        task: TaskSpec,
        sampling: SamplingSpec,
        renderer: ChatRenderer,
        generate: Generator,
        min_version: Callable[[], int] = lambda: 0,
    ) -> None:
        self.episode_id = episode_id
        self.task, self.sampling, self.renderer = task, sampling, renderer
        self._generate, self._min_version = generate, min_version
        self.history = TurnHistory()
        self.prompt_ids: list[int] | None = None
        """The first call's prompt: the trajectory's prompt."""
        self.turns = 0
        self.closed: str | None = None
        """Why the episode ended; None while it runs."""
        self.report: EpisodeReport | None = None
        """What the program reported at its end, if it did."""
        self._current: list[int] = []
        self._since = 0
        self._known: list[tuple[Normal, ...]] = []
        """The conversation so far as the agent may repeat it: each message's accepted forms."""
        self._before_reply: list[dict[str, Any]] = []
        self._last_generated: list[int] = []
        self._lock = asyncio.Lock()
        self._calls: set[asyncio.Task[Any]] = set()

    # -- the two kinds of call ---------------------------------------------------------------------

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        allowed: set[str] | None = None,
        max_tokens: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        seed: int | None = None,
    ) -> Reply:
        """Generate the assistant's next turn of `messages` (OpenAI chat messages)."""
        rendered = [_for_template(i, m) for i, m in enumerate(messages)]
        options = {**self.task.chat_options(), **(template_kwargs or {})}
        if tools:
            options["tools"] = tools
        normal = [_normal(m) for m in rendered]
        async with self._serving():
            if self.prompt_ids is None:
                self._start(
                    self.renderer.encode(self.renderer.render(rendered, generation_prompt=True, options=options))
                )
            elif self._continues(normal):
                following = rendered[len(self._known) :]
                self.history.context(
                    self.renderer.continuation(self._before_reply, self._last_generated, following, options=options)
                )
            else:
                self._fresh(
                    self.renderer.encode(self.renderer.render(rendered, generation_prompt=True, options=options))
                )
            generated = await self._turn(max_tokens, seed)
            reply = self.renderer.decode(generated.token_ids)
            text = ChatRenderer.answer(reply)
            reasoning = reply.rsplit(THINK_END, 1)[0].replace("<think>", "").strip() if THINK_END in reply else None
            content: str | None = text
            calls: list[ToolCall] = []
            error = None
            try:
                content, calls = parse_tool_calls(text, allowed=allowed or set(), choice=tool_choice)
            except MalformedToolCall as exc:
                error = exc
            returned = {"role": "assistant", "content": content, "tool_calls": [c.openai("") for c in calls]}
            self._known = [(n,) for n in normal] + [
                (_normal(returned), _normal({"role": "assistant", "content": text}))
            ]
            self._before_reply = rendered
            self._last_generated = generated.token_ids
            return Reply(text, reasoning, content, calls, error, generated, self.turns - 1)

    async def complete(
        self, prompt: str | list[int], *, max_tokens: int | None = None, seed: int | None = None
    ) -> Generated:
        """Generate a continuation of `prompt` (text, or token ids) for the legacy completions API. A prompt
        that extends the episode's current sequence continues it; any other starts a fresh one."""
        ids = self.renderer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise AgentCallError(400, "invalid_prompt", "the prompt is empty")
        async with self._serving():
            if self.prompt_ids is None:
                self._start(ids)
            else:
                context = self.context()
                if len(ids) > len(context) and ids[: len(context)] == context:
                    self.history.context(ids[len(context) :])
                else:
                    self._fresh(ids)
            self._known = []  # a chat call after this starts a fresh sequence
            return await self._turn(max_tokens, seed)

    # -- state ---------------------------------------------------------------------------------------

    def context(self) -> list[int]:
        """The token sequence the next turn continues."""
        return self._current + self.history.ids[self._since :]

    def close(self, reason: str, *, spare: asyncio.Task[Any] | None = None) -> None:
        """End the episode: every call in flight (but `spare`) fails with `reason`, and so does every later one."""
        if self.closed is None:
            self.closed = reason
        for call in list(self._calls):
            if call is not spare:
                call.cancel(reason)

    def _render(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> list[int]:
        return self.renderer.encode(self.renderer.render(messages, generation_prompt=True, options=options))

    def _start(self, ids: list[int]) -> None:
        self.prompt_ids = ids
        self._current, self._since = ids, 0

    def _fresh(self, ids: list[int]) -> None:
        self.history.fresh_prompt(ids)
        self._current, self._since = ids, len(self.history.ids)

    def _continues(self, normal: list[Normal]) -> bool:
        known = self._known
        return bool(known) and len(normal) > len(known) and all(n in k for n, k in zip(normal, known, strict=False))

    def _serving(self) -> _Serving:
        return _Serving(self)

    async def _turn(self, max_tokens: int | None, seed: int | None) -> Generated:
        task = self.task
        if task.max_turns is not None and self.turns >= task.max_turns:
            raise AgentCallError(
                400, "turn_limit", f"the episode has had its {task.max_turns} turns (the task's max_turns)"
            )
        context = self.context()
        budget = min(
            max_tokens or task.max_tokens_per_turn, task.max_tokens_per_turn, task.max_total_tokens - len(context)
        )
        if budget <= 0:
            raise AgentCallError(
                400,
                "context_length_exceeded",
                f"the episode's {len(context)} tokens leave no room under the task's max_total_tokens "
                f"({task.max_total_tokens})",
            )
        request = turn_request(
            self.episode_id,
            self.turns,
            context,
            max_tokens=budget,
            sampling=self.sampling,
            stop_ids=self.renderer.stop_ids,
            min_version=self._min_version(),
            seed=seed,
        )
        result = await self.history.timed("gen", self._generate(request))
        if result.finish_reason == "abort":
            self.close(f"turn {self.turns} was aborted on {result.generator}", spare=asyncio.current_task())
            raise EpisodeClosed(self.episode_id, self.closed or "aborted")
        self.history.generated(result, ChatRenderer.answer(self.renderer.decode(result.token_ids)))
        self.turns += 1
        return result


class _Serving:
    """One call at a time per episode; a call in flight ends with the episode (`AgentEpisode.close`)."""

    def __init__(self, episode: AgentEpisode) -> None:
        self.episode = episode

    async def __aenter__(self) -> None:
        episode = self.episode
        task = asyncio.current_task()
        assert task is not None
        episode._calls.add(task)
        try:
            await episode._lock.acquire()
        except asyncio.CancelledError:
            episode._calls.discard(task)
            if episode.closed is None:  # not closed: the caller went away
                raise
            raise EpisodeClosed(episode.episode_id, episode.closed) from None
        if episode.closed is not None:
            episode._lock.release()
            episode._calls.discard(task)
            raise EpisodeClosed(episode.episode_id, episode.closed)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        episode = self.episode
        episode._lock.release()
        episode._calls.discard(asyncio.current_task())
        if kind is asyncio.CancelledError and episode.closed is not None:
            raise EpisodeClosed(episode.episode_id, episode.closed) from None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise AgentCallError(400, "invalid_content", f"{where}: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise AgentCallError(400, "invalid_content", f"{where}: content must be a string or a list of text parts")


def _for_template(i: int, message: Any) -> dict[str, Any]:
    """An OpenAI chat message as the chat template takes it (text content; tool calls with parsed arguments)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise AgentCallError(400, "invalid_message", f"{where}: a message needs a role among {list(ROLES)}")
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
    calls = message.get("tool_calls") or []
    if calls and role == "assistant":
        out["tool_calls"] = [_call_for_template(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _call_for_template(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise AgentCallError(400, "invalid_message", f"{where}: a tool call needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise AgentCallError(400, "invalid_message", f"{where}: function.arguments is not JSON") from exc
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _normal(message: dict[str, Any]) -> Normal:
    calls = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in (_call_for_template("", c) for c in message.get("tool_calls") or [])
    ]
    return (
        message["role"],
        message.get("content") or "",
        json.dumps(calls, sort_keys=True) if calls else "",
        message.get("tool_call_id") or "",
        message.get("name") or "",
    )
