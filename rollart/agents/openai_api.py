"""The OpenAI-compatible endpoint an env-host serves to agent programs.

Each agent episode gets its own base URL and key:

    base_url = http://<host>:<port>/e/<episode id>/v1        api_key = <a random key for that episode>

so every call is attributed to its episode, and a program needs nothing but an OpenAI client pointed there.
Served: `POST /chat/completions` (tools, `tool_choice`, streaming, log-probs), `POST /completions` (text or
token-id prompts) and `GET /models`. Each call is one turn of the episode (`rollart.agents.episode`),
generated through the env-host's `LLMProxy` like any turn.

What differs from OpenAI's API, on purpose:
- sampling is the run's (`run.rollout.sampling`), not the request's `temperature` and `top_p`: the trainer
  needs the behaviour distribution it was told; `n` must be 1 and `stop` strings are refused (a turn ends at
  the model's own stop tokens);
- `max_tokens` is capped by the task's `max_tokens_per_turn` and `max_total_tokens`;
- a streamed response comes once its turn is generated (generators answer whole turns), in the chunk
  format OpenAI clients read;
- a reply whose tool calls cannot be parsed is answered 422 (`malformed_tool_call`) with the reason and the
  reply's text in the error (`error.reply`), so the agent can show the model what went wrong; its tokens
  are part of the episode all the same;
- `POST /rollart/report` (`{"reward": ..., "success": ..., "answer": ...}`) is the program's own account of its
  episode, its reward when the task says `reward: report`;
- a call of an episode that ended (finished, cancelled as a redundant extra, too stale for the staleness
  bound) is refused 409 (`episode_closed`) with the reason.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import web

from rollart.agents.episode import AgentCallError, AgentEpisode, EpisodeClosed, EpisodeReport, Reply
from rollart.agents.tool_calls import forced_tool, tool_names
from rollart.errors import RollartError
from rollart.protocol.messages import Generated

log = structlog.get_logger("rollart.agents")

CLOSED_REMEMBERED = 10_000
"""Closed episodes whose reason a late call still gets (older ones answer 404)."""
MAX_BODY_BYTES = 32 * 1024**2


class ChatRequest(msgspec.Struct, kw_only=True):
    """The fields of a chat-completions request this endpoint reads (others are ignored)."""

    messages: list[Any]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[Any]
    """Text, token ids, or a list of one text."""
    model: str = ""
    max_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    echo: bool = False


@dataclass(frozen=True)
class EpisodeAccess:
    """What an agent program is given: its episode's base URL and key."""

    base_url: str
    api_key: str
    unix_socket: str | None = None
    """Where the same endpoint listens on a Unix socket (for sandboxes without a network), if it does."""


class AgentEndpoint:
    """The HTTP server of the agent episodes of one env-host."""

    def __init__(
        self,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        unix_socket: Path | None = None,
    ) -> None:
        self.model_name = model_name
        self.host, self.port, self.unix_socket = host, port, unix_socket
        self.episodes: dict[str, tuple[AgentEpisode, str]] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._runner: web.AppRunner | None = None
        self.calls: collections.Counter[str] = collections.Counter()

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/e/{episode}/v1/chat/completions", self._guarded(self.chat))
        app.router.add_post("/e/{episode}/v1/completions", self._guarded(self.completions))
        app.router.add_get("/e/{episode}/v1/models", self._guarded(self.models))
        app.router.add_post("/e/{episode}/v1/rollart/report", self._guarded(self.report))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        if self.unix_socket is not None:
            self.unix_socket.unlink(missing_ok=True)  # a stale socket from an earlier life of this node
            await web.UnixSite(self._runner, str(self.unix_socket)).start()
            # A sandboxed agent may run as nobody: connecting needs write permission on the socket. The
            # per-episode keys, not the socket's mode, decide who is served.
            self.unix_socket.chmod(0o666)
        log.info("agents.endpoint", host=self.host, port=self.port, unix_socket=str(self.unix_socket or ""))

    async def stop(self) -> None:
        for episode, _ in list(self.episodes.values()):
            self.close(episode.episode_id, "the env-host is stopping")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode: AgentEpisode) -> EpisodeAccess:
        """Serve `episode` from now on; returns its base URL and key."""
        key = f"ra-{secrets.token_urlsafe(24)}"
        self.episodes[episode.episode_id] = (episode, key)
        return EpisodeAccess(
            self.base_url(episode.episode_id), key, str(self.unix_socket) if self.unix_socket else None
        )

    def base_url(self, episode_id: str) -> str:
        """Where an episode's calls go, over TCP."""
        return f"http://{_url_host(self.host)}:{self.port}/e/{episode_id}/v1"

    def close(self, episode_id: str, reason: str) -> None:
        """End an episode: calls in flight and later calls are refused with `reason`."""
        entry = self.episodes.pop(episode_id, None)
        if entry is None:
            return
        entry[0].close(reason)
        self._closed[episode_id] = reason
        while len(self._closed) > CLOSED_REMEMBERED:
            self._closed.popitem(last=False)

    # -- handlers ------------------------------------------------------------------------------------

    def _guarded(
        self, handler: Callable[[web.Request, AgentEpisode], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """`handler` behind the episode lookup and key check, with every refusal in OpenAI's error shape."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            episode_id = request.match_info["episode"]
            try:
                episode = self._episode(episode_id, request.headers.get("Authorization", ""))
                self.calls[request.path.rsplit("/", 1)[1]] += 1
                return await handler(request, episode)
            except AgentCallError as exc:
                if exc.status >= 500 or isinstance(exc, EpisodeClosed):
                    log.info("agents.refused", episode=episode_id, code=exc.code, error=str(exc))
                return _error(exc.status, exc.code, str(exc), **exc.extra)
            except RollartError as exc:  # the proxy gave up on every generator
                log.warning("agents.failed", episode=episode_id, error=str(exc))
                return _error(503, "generation_failed", str(exc))

        return guarded

    def _episode(self, episode_id: str, authorization: str) -> AgentEpisode:
        entry = self.episodes.get(episode_id)
        if entry is None:
            if episode_id in self._closed:
                raise EpisodeClosed(episode_id, self._closed[episode_id])
            raise AgentCallError(404, "unknown_episode", f"no episode {episode_id} on this env-host")
        episode, key = entry
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise AgentCallError(401, "invalid_api_key", f"wrong or missing key for episode {episode_id}")
        return episode

    async def report(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        """The program's own account of its episode: `{"reward": 1.0, "success": true, "answer": "42"}`."""
        if episode.closed is not None:
            raise EpisodeClosed(episode.episode_id, episode.closed)
        episode.report = _decode(await request.read(), EpisodeReport)
        return web.json_response({"ok": True})

    async def models(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollart"}
        return web.json_response({"object": "list", "data": [model]})

    async def chat(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        body = _decode(await request.read(), ChatRequest)
        _check_common(body.n, body.stop)
        try:
            allowed = tool_names(body.tools)
            forced_tool(body.tool_choice, allowed)
        except ValueError as exc:
            raise AgentCallError(400, "invalid_tools", str(exc)) from exc
        reply = await episode.chat(
            body.messages,
            tools=body.tools,
            tool_choice=body.tool_choice,
            allowed=allowed,
            max_tokens=body.max_completion_tokens or body.max_tokens,
            template_kwargs=body.chat_template_kwargs,
            seed=body.seed,
        )
        if reply.tool_error is not None:
            raise _malformed(reply)
        call_id = f"chatcmpl-{episode.episode_id}-{reply.turn}"
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [
                c.openai(f"call-{episode.episode_id}-{reply.turn}-{i}") for i, c in enumerate(reply.tool_calls)
            ]
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        finish = "tool_calls" if reply.tool_calls else _finish(reply.generated)
        usage = _usage(reply.generated)
        logprobs = _logprobs(episode, reply.generated) if body.logprobs else None
        if body.stream:
            head = {"id": call_id, "created": int(time.time()), "model": self.model_name}
            return await _stream_chat(request, head, message, finish=finish, usage=usage, options=body.stream_options)
        return web.json_response(
            {
                "id": call_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
                "usage": usage,
            }
        )

    async def completions(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        body = _decode(await request.read(), CompletionRequest)
        _check_common(body.n, body.stop)
        prompt = _prompt(body.prompt)
        generated = await episode.complete(prompt, max_tokens=body.max_tokens, seed=body.seed)
        text = episode.renderer.decode(generated.token_ids)
        if body.echo:
            text = (prompt if isinstance(prompt, str) else episode.renderer.decode(prompt)) + text
        call_id = f"cmpl-{episode.episode_id}-{episode.turns - 1}"
        choice = {"index": 0, "text": text, "finish_reason": _finish(generated), "logprobs": None}
        usage = _usage(generated)
        if body.stream:
            response = await _sse(request)
            chunk = {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
            await _send(response, {**chunk, "choices": [choice]})
            if (body.stream_options or {}).get("include_usage"):
                await _send(response, {**chunk, "choices": [], "usage": usage})
            return await _done(response)
        return web.json_response(
            {
                "id": call_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": usage,
            }
        )


def _malformed(reply: Reply) -> AgentCallError:
    why = f"the model's tool call cannot be used: {reply.tool_error}"
    return AgentCallError(422, "malformed_tool_call", why, reply=reply.text)


async def _stream_chat(
    request: web.Request,
    head: dict[str, Any],
    message: dict[str, Any],
    *,
    finish: str,
    usage: dict[str, int],
    options: dict[str, Any] | None,
) -> web.StreamResponse:
    """A chat completion as OpenAI streams one: role, reasoning, content, each tool call, the finish, the usage."""
    response = await _sse(request)
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    await _send(response, chunk({"role": "assistant", "content": ""}))
    if "reasoning_content" in message:
        await _send(response, chunk({"reasoning_content": message["reasoning_content"]}))
    if message["content"]:
        await _send(response, chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls", [])):
        await _send(response, chunk({"tool_calls": [{"index": i, **call}]}))
    await _send(response, chunk({}, finish))
    if (options or {}).get("include_usage"):
        await _send(response, {**head, "choices": [], "usage": usage})
    return await _done(response)


def _logprobs(episode: AgentEpisode, generated: Generated) -> dict[str, Any]:
    """OpenAI's `logprobs.content`: each generated token with its behaviour log-prob (no alternatives)."""
    tokens = [episode.renderer.tokenizer.convert_ids_to_tokens(t) for t in generated.token_ids]
    return {
        "content": [
            {"token": str(token), "logprob": lp, "bytes": list(str(token).encode()), "top_logprobs": []}
            for token, lp in zip(tokens, generated.logprobs, strict=True)
        ]
    }


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise AgentCallError(400, "invalid_request", f"bad request body: {exc}") from exc


def _prompt(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, str) or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise AgentCallError(400, "invalid_prompt", "prompt: one text or one list of token ids per call")


def _check_common(n: int, stop: str | list[str] | None) -> None:
    if n != 1:
        raise AgentCallError(400, "unsupported", "n must be 1: run several episodes for several samples")
    if stop:
        raise AgentCallError(
            400, "unsupported", "stop strings are not supported: a turn ends at the model's stop tokens"
        )


def _finish(generated: Generated) -> str:
    return "length" if generated.finish_reason == "length" else "stop"


def _usage(generated: Generated) -> dict[str, int]:
    completion = len(generated.token_ids)
    return {
        "prompt_tokens": generated.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": generated.prompt_tokens + completion,
    }


def _error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": None, "code": code, **extra}
    return web.json_response({"error": error}, status=status)


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + msgspec.json.encode(data) + b"\n\n")


async def _done(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
