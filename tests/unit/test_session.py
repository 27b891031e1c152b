"""Tests of persistent sessions over the in-memory network: exactly-once delivery across broken
connections and server restarts, request errors, cancellation, heartbeats, backpressure,
giving up, closing, refusals and linger.

Every test owns its server and client tasks in one `asyncio.TaskGroup` and closes them at the end,
so a task that would not end makes the test time out instead of leaking.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from rollart.protocol.auth import Identity, client_handshake
from rollart.protocol.client import ClientSession
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, RemoteError, RequestTimeout, SessionLost, UnexpectedReply
from rollart.protocol.memory import MemoryConnection, MemoryNetwork
from rollart.protocol.messages import (
    CONTROL,
    Channel,
    ControlMsg,
    Echo,
    GroupTask,
    NodeStatus,
    NoTask,
    Notice,
    StatusRequest,
    TaskWanted,
    reply_types,
)
from rollart.protocol.server import SessionServer
from rollart.protocol.session import Session, State

ADDRESS = "gen-0"
SECRET = b"shared test secret"
CFG = SessionConfig(
    heartbeat_interval_s=0.05,
    heartbeat_deadline_s=0.25,
    handshake_timeout_s=1.0,
    backoff_base_s=0.005,
    backoff_cap_s=0.02,
    give_up_after_s=5.0,
    linger_s=5.0,
    default_request_timeout_s=5.0,
)


class Recorder:
    """A handler that records what it gets, answers `Echo` with the same `Echo`, and lets a test
    wait for what it has seen; `hook(n)` runs inside the handler for message `n`."""

    def __init__(self, hook: Callable[[int], Any] | None = None) -> None:
        self.events: list[int] = []
        self.requests: list[int] = []
        self.hook = hook
        self._changed = asyncio.Event()

    async def on_event(self, session: Session, msg: Any) -> None:
        self.events.append(msg.n)
        self._changed.set()
        if self.hook is not None:
            await self._run_hook(msg.n)

    async def on_request(self, session: Session, msg: Any) -> Any:
        self.requests.append(msg.n)
        self._changed.set()
        if self.hook is not None:
            await self._run_hook(msg.n)
        return msg

    async def _run_hook(self, n: int) -> None:
        assert self.hook is not None
        result = self.hook(n)
        if asyncio.iscoroutine(result):
            await result

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                self._changed.clear()
                await self._changed.wait()


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll a condition no event announces, for at most `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - these conditions have no event to wait on
            await asyncio.sleep(0.005)


async def start_server(
    tg: asyncio.TaskGroup,
    net: MemoryNetwork,
    handler: Any,
    cfg: SessionConfig = CFG,
    *,
    channel: Channel[Any] = CONTROL,
    secret: bytes = SECRET,
) -> tuple[SessionServer, asyncio.Task[None]]:
    server = SessionServer(
        local=Identity(ADDRESS, "generator"), secret=secret, channel=channel, handler=handler, cfg=cfg
    )
    task = tg.create_task(server.serve())
    await server._started.wait()  # accept() turns connections away until serve() owns its task group
    net.listen(ADDRESS, server.accept)
    return server, task


def start_client(
    tg: asyncio.TaskGroup,
    net: MemoryNetwork,
    handler: Any = None,
    cfg: SessionConfig = CFG,
    *,
    channel: Channel[Any] = CONTROL,
    secret: bytes = SECRET,
    name: str = "env-0",
) -> tuple[ClientSession, asyncio.Task[None]]:
    client = ClientSession(
        lambda: net.connect(ADDRESS, name),
        secret=secret,
        local=Identity(name, "env-host"),
        channel=channel,
        handler=handler,
        cfg=cfg,
        peer_name=ADDRESS,
    )
    return client, tg.create_task(client.run())


def server_end(net: MemoryNetwork, client_name: str = "env-0") -> MemoryConnection:
    """The server's end of the client's open connection."""
    (conn,) = [c for c in net.connections if c.peer == client_name and not c.closed]
    return conn


# -- exactly once, in order, across broken connections ---------------------------------------


@pytest.mark.timeout(30)
async def test_client_events_survive_breaks_exactly_once_in_order() -> None:
    net = MemoryNetwork()
    cfg = msgspec.structs.replace(CFG, resend_buffer=64)
    # Breaks come from both ends: from the handler mid-stream and from the sender between sends.
    handler = Recorder(hook=lambda n: net.break_all() if n % 450 == 200 else None)
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler, cfg)
        client, _ = start_client(tg, net, cfg=cfg)
        for i in range(2000):
            await client.send(Echo(i))
            if i % 300 == 299:
                net.break_all()
        await handler.wait_until(lambda: len(handler.events) >= 2000)
        server_stats = server.sessions[client.id].stats
        await client.close()
        await server.close()
    assert handler.events == list(range(2000))
    assert client.stats.connects >= 8
    assert client.stats.resent > 0  # frames in flight were lost and sent again
    assert server_stats.duplicates == 0  # and only those: the handshake says what arrived


@pytest.mark.timeout(30)
async def test_server_events_survive_breaks_exactly_once_in_order() -> None:
    net = MemoryNetwork()
    cfg = msgspec.structs.replace(CFG, resend_buffer=64)
    received = Recorder(hook=lambda n: net.break_all() if n % 450 == 200 else None)
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, Recorder(), cfg)
        client, _ = start_client(tg, net, received, cfg)
        await client.up.wait()
        session = server.sessions[client.id]
        for i in range(2000):
            await session.send(Echo(i))
            if i % 300 == 299:
                net.break_all()
        await received.wait_until(lambda: len(received.events) >= 2000)
        await client.close()
        await server.close()
    assert received.events == list(range(2000))
    assert session.stats.resent > 0
    assert client.stats.duplicates == 0


@pytest.mark.timeout(30)
async def test_requests_across_breaks_get_exactly_one_matching_response() -> None:
    net = MemoryNetwork()
    cfg = msgspec.structs.replace(CFG, resend_buffer=32)
    handler = Recorder(hook=lambda n: net.break_all() if n % 170 == 50 else None)
    responses: list[int] = []
    in_flight = asyncio.Semaphore(48)

    async def call(i: int) -> None:
        async with in_flight:
            reply = await client.request(Echo(i, i.to_bytes(4, "big")), timeout=10)
        assert reply == Echo(i, i.to_bytes(4, "big"))
        responses.append(i)
        if len(responses) % 200 == 0 and len(responses) < 1000:
            net.break_all()

    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler, cfg)
        client, _ = start_client(tg, net, cfg=cfg)
        async with asyncio.TaskGroup() as callers:
            for i in range(1000):
                callers.create_task(call(i))
        # The handler may have broken the connection at the very end; make sure it is up again so
        # the client's Bye reaches the server (otherwise the server's close waits for its acks).
        assert await client.request(Echo(-1)) == Echo(-1)
        await client.close()
        await server.close()
    assert sorted(responses) == list(range(1000))
    # The server kept the session, so no request ran twice.
    assert collections.Counter(handler.requests) == collections.Counter([*range(1000), -1])
    assert client.stats.connects >= 5


@pytest.mark.timeout(30)
async def test_server_restart_resends_only_unacknowledged_events_and_answers_every_request() -> None:
    net = MemoryNetwork()
    stuck = asyncio.Event()

    async def old_hook(n: int) -> None:
        # The old server never answers a request, and hangs for good on event 100.
        if n >= 100:
            stuck.set()
            await asyncio.Event().wait()

    old_handler, new_handler = Recorder(hook=old_hook), Recorder()
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        old_server, old_task = await start_server(tg, net, old_handler)
        client, _ = start_client(tg, net)
        for i in range(100):
            await client.send(Echo(i))
        # Requests the old server acknowledged and started, but will never answer.
        requests = [tg.create_task(client.request(Echo(1000 + i), timeout=10)) for i in range(10)]
        await old_handler.wait_until(lambda: len(old_handler.requests) == 10)
        await until(lambda: client.describe()["unacked"] == 0)  # events 0..99 acknowledged too
        for i in range(100, 150):
            await client.send(Echo(i))
        # Requests queued behind event 100: received by the old server, never acknowledged.
        requests += [tg.create_task(client.request(Echo(1010 + i), timeout=10)) for i in range(10)]
        await stuck.wait()

        # The old server process dies; a new one with a new epoch takes over its address.
        new_server, _ = await start_server(tg, net, new_handler)
        assert new_server.epoch != old_server.epoch
        old_task.cancel()
        for i in range(150, 200):  # sent while the client is reconnecting
            await client.send(Echo(i))
        replies = await asyncio.gather(*requests)
        await new_handler.wait_until(lambda: len(new_handler.events) >= 100)
        await client.close()
        await new_server.close()

    assert replies == [Echo(1000 + i) for i in range(20)]
    assert sorted(old_handler.requests) == [1000 + i for i in range(10)]
    assert old_handler.events == list(range(101))
    # Event 100 was being handled but not acknowledged: the only one that reaches both servers.
    assert new_handler.events == list(range(100, 200))
    assert sorted(new_handler.requests) == [1000 + i for i in range(20)]
    assert client.stats.connects == 2
    assert client.stats.late_responses == 0


# -- request failures and cancellation --------------------------------------------------------


class Blocking:
    """A request handler that never answers and records being cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def on_event(self, session: Session, msg: Any) -> None:
        pass

    async def on_request(self, session: Session, msg: Any) -> Any:
        if isinstance(msg, Echo) and msg.n == 0:
            return msg  # lets a test check the session still works
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_request_timeout_raises_and_cancels_the_handler() -> None:
    net = MemoryNetwork()
    handler = Blocking()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler)
        client, _ = start_client(tg, net)
        with pytest.raises(RequestTimeout, match=r"Echo request to gen-0 timed out after 0\.2 s"):
            await client.request(Echo(1), timeout=0.2)
        assert handler.started.is_set()
        async with asyncio.timeout(0.5):
            await handler.cancelled.wait()
        assert client.stats.request_timeouts == 1
        assert await client.request(Echo(0)) == Echo(0)
        await client.close()
        await server.close()


async def test_cancelling_the_caller_cancels_the_remote_handler() -> None:
    net = MemoryNetwork()
    handler = Blocking()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler)
        client, _ = start_client(tg, net)
        caller = asyncio.create_task(client.request(Echo(1), timeout=30))
        await handler.started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        # The handler's own deadline is 30 s away: only the caller's CANCEL can stop it this soon.
        async with asyncio.timeout(2):
            await handler.cancelled.wait()
        await until(lambda: server.sessions[client.id].describe()["serving"] == 0)
        assert await client.request(Echo(0)) == Echo(0)
        await client.close()
        await server.close()


class Failing:
    async def on_event(self, session: Session, msg: Any) -> None:
        raise ValueError(f"cannot handle {msg!r}")

    async def on_request(self, session: Session, msg: Any) -> Any:
        match msg:
            case Echo(n=1):
                raise RemoteError("unknown-task", "no task with id 1")
            case Echo(n=2):
                raise ValueError("bad value 2")
            case _:
                return msg


async def test_handler_failures_reach_the_caller_as_remote_errors() -> None:
    net = MemoryNetwork()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, Failing())
        client, _ = start_client(tg, net)
        with pytest.raises(RemoteError) as info:
            await client.request(Echo(1))
        assert (info.value.code, info.value.message) == ("unknown-task", "no task with id 1")
        with pytest.raises(RemoteError) as info:
            await client.request(Echo(2))
        assert info.value.code == "handler-error"
        assert "ValueError: bad value 2" in info.value.message
        await client.send(Notice("an event whose handler fails"))
        assert await client.request(Echo(3)) == Echo(3)
        session = server.sessions[client.id]
        # the event's handler runs beside the requests: its failure may be counted after Echo(3)'s reply
        await until(lambda: session.stats.handler_errors >= 2)
        assert session.stats.handler_errors == 2
        assert session.state is State.UP
        await client.close()
        await server.close()


async def test_an_event_to_a_session_without_handler_is_dropped_and_the_session_goes_on() -> None:
    net = MemoryNetwork()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, Recorder())
        client, _ = start_client(tg, net)  # no handler: it only makes requests
        await client.up.wait()
        with capture_logs() as logs:
            await server.sessions[client.id].send(Notice("nobody listens"))
            await until(lambda: any(entry["event"] == "session.unhandled_event" for entry in logs))
        assert await client.request(Echo(4)) == Echo(4)
        await client.close()
        await server.close()


class Extra(msgspec.Struct, tag="extra", array_like=True, frozen=True):
    """A message the server's channel does not know."""

    x: int


WIDER = Channel("control+extra", ControlMsg | Extra)


async def test_bad_request_body_is_answered_with_bad_request_and_the_session_goes_on() -> None:
    net = MemoryNetwork()
    handler = Recorder()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler)
        client, _ = start_client(tg, net, channel=WIDER)
        with pytest.raises(RemoteError) as info:
            await client.request(Extra(1))
        assert info.value.code == "bad-request"
        assert "unknown message tag 'extra'" in info.value.message
        await client.send(Extra(2))  # an undecodable event is dropped, not fatal
        await client.send(Echo(7))
        assert await client.request(Echo(8)) == Echo(8)
        await handler.wait_until(lambda: handler.events == [7])
        assert server.sessions[client.id].stats.decode_errors == 2
        await client.close()
        await server.close()


class WrongReplies:
    """Answers `StatusRequest` with an `Echo` (not the `NodeStatus` it declares) and `Echo` as it should."""

    async def on_event(self, session: Session, msg: Any) -> None:
        pass

    async def on_request(self, session: Session, msg: Any) -> Any:
        return Echo(-1) if isinstance(msg, StatusRequest) else msg


def test_requests_declare_their_replies() -> None:
    assert reply_types(Echo) == (Echo,)
    assert reply_types(StatusRequest) == (NodeStatus,)
    assert reply_types(TaskWanted) == (GroupTask, NoTask)
    assert reply_types(Notice) is None  # an event: it declares no reply


async def test_a_reply_of_another_type_than_declared_fails_that_request_and_the_session_goes_on() -> None:
    net = MemoryNetwork()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, WrongReplies())
        client, _ = start_client(tg, net)
        with pytest.raises(UnexpectedReply) as info:
            await client.request(StatusRequest())
        assert str(info.value) == "control channel: gen-0 answered StatusRequest with Echo; expected NodeStatus"
        assert await client.request(Echo(2)) == Echo(2)
        assert client.state is State.UP
        await client.close()
        await server.close()


# -- liveness and flow control ---------------------------------------------------------------


async def test_silent_peer_is_detected_within_the_heartbeat_deadline_and_the_session_recovers() -> None:
    net = MemoryNetwork()
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, Recorder())
        client, _ = start_client(tg, net)
        assert await client.request(Echo(1)) == Echo(1)
        server_end(net).silent = True  # the server hangs but keeps its socket
        silenced_at = loop.time()
        await until(lambda: client.stats.disconnects == 1, timeout=CFG.heartbeat_deadline_s + 0.5)
        dropped_after = loop.time() - silenced_at
        assert client.stats.silent_peer == 1
        assert dropped_after >= CFG.heartbeat_deadline_s / 2  # not before the peer could be silent
        assert dropped_after <= CFG.heartbeat_deadline_s + 0.5
        assert await client.request(Echo(2)) == Echo(2)  # on a new connection, same session
        assert client.stats.connects == 2
        assert server.sessions[client.id].stats.connects == 2
        await client.close()
        await server.close()


async def test_full_resend_buffer_makes_send_wait_until_the_peer_catches_up() -> None:
    net = MemoryNetwork()
    cfg = msgspec.structs.replace(CFG, resend_buffer=8)
    release = asyncio.Event()

    async def block_first(n: int) -> None:
        if n == 0:
            await release.wait()

    handler = Recorder(hook=block_first)
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler, cfg)
        client, _ = start_client(tg, net, cfg=cfg)
        await client.up.wait()
        for i in range(8):
            async with asyncio.timeout(1):
                await client.send(Echo(i))  # room in the buffer: no wait
        ninth = asyncio.create_task(client.send(Echo(8)))
        rest = asyncio.create_task(client.send(Echo(9)))
        await handler.wait_until(lambda: handler.events == [0])
        # Several heartbeats pass; nothing is acknowledged while the handler is stuck.
        done, _ = await asyncio.wait([ninth], timeout=4 * cfg.heartbeat_interval_s)
        assert not done
        assert client.describe()["unacked"] == 8
        release.set()
        async with asyncio.timeout(2):
            await ninth
            await rest
        await handler.wait_until(lambda: len(handler.events) == 10)
        await client.close()
        await server.close()
    assert handler.events == list(range(10))


# -- ending sessions ---------------------------------------------------------------------------


async def test_client_gives_up_when_nobody_listens() -> None:
    net = MemoryNetwork()
    cfg = msgspec.structs.replace(CFG, give_up_after_s=0.5)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        client = ClientSession(
            lambda: net.connect("nobody-here"),
            secret=SECRET,
            local=Identity("env-0", "env-host"),
            channel=CONTROL,
            cfg=cfg,
        )
        pending = asyncio.create_task(client.request(Echo(1), timeout=5))
        started = loop.time()
        with pytest.raises(SessionLost, match="no connection"):
            await client.run()
        assert loop.time() - started < 1.0
        with pytest.raises(SessionLost):
            await pending
    assert client.state is State.FAILED


async def test_client_close_ends_the_server_session() -> None:
    net = MemoryNetwork()
    handler = Recorder()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, handler)
        client, client_task = start_client(tg, net)
        for i in range(50):
            await client.send(Echo(i))
        await client.close()
        async with asyncio.timeout(2):
            await client_task  # run() returns once closed
        session = server.sessions[client.id]
        await until(lambda: session.finished)
        assert session.state is State.CLOSED
        assert handler.events == list(range(50))  # everything acknowledged before the Bye
        with pytest.raises(SessionLost, match="closed"):
            await client.send(Echo(99))
        await server.close()


async def test_server_close_says_bye_and_the_client_starts_fresh_with_a_new_server() -> None:
    net = MemoryNetwork()
    release = asyncio.Event()
    slow_handler = Recorder(hook=lambda n: release.wait())
    new_handler = Recorder()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        old_server, old_task = await start_server(tg, net, Recorder())
        client, _ = start_client(tg, net)
        slow, _ = start_client(tg, net, slow_handler, name="env-1")
        assert await client.request(Echo(1)) == Echo(1)
        await slow.up.wait()
        # The closing server waits (up to its timeout) for `slow` to acknowledge this event,
        # while `client`, already told Bye, keeps coming back to the address.
        await old_server.sessions[slow.id].send(Echo(7))
        await slow_handler.wait_until(lambda: slow_handler.events == [7])
        late = await net.connect(ADDRESS, "late")  # accepted just before the close begins
        with capture_logs() as logs:
            closing = asyncio.create_task(old_server.close("draining", timeout=0.5))
            await asyncio.sleep(0)  # let the close begin
            with pytest.raises(ConnectionClosed):
                await client_handshake(
                    late, identity=Identity("late", "env-host"), secret=SECRET, session_id="late", timeout=1
                )
            await closing
            async with asyncio.timeout(2):
                await old_task  # a client let back in during the close would keep it running
            await until(lambda: sum(entry["event"] == "session.server_bye" for entry in logs) == 2)
        assert all(entry["reason"] == "draining" for entry in logs if entry["event"] == "session.server_bye")
        assert set(old_server.sessions) == {client.id, slow.id}
        assert all(session.finished for session in old_server.sessions.values())
        assert client.state is not State.UP

        new_server, _ = await start_server(tg, net, new_handler)
        assert await client.request(Echo(2)) == Echo(2)
        assert new_handler.requests == [2]
        assert new_server.sessions[client.id].stats.connects == 1
        release.set()
        await client.close()
        await slow.close()
        await new_server.close()


async def test_wrong_secret_is_refused_and_the_server_goes_on_serving() -> None:
    net = MemoryNetwork()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, Recorder())
        intruder = ClientSession(
            lambda: net.connect(ADDRESS, "intruder"),
            secret=b"not the secret",
            local=Identity("intruder", "env-host"),
            channel=CONTROL,
            cfg=CFG,
        )
        with pytest.raises(SessionLost, match=r"\(auth\).*wrong shared secret"):
            await intruder.run()
        assert server.refusals == 1
        assert intruder.id not in server.sessions
        client, _ = start_client(tg, net)
        assert await client.request(Echo(5)) == Echo(5)
        await client.close()
        await server.close()


async def test_server_forgets_a_client_that_does_not_come_back_after_linger() -> None:
    net = MemoryNetwork()
    cfg = msgspec.structs.replace(CFG, linger_s=0.6)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        server, _ = await start_server(tg, net, Recorder(), cfg)
        client, client_task = start_client(tg, net, cfg=cfg)
        assert await client.request(Echo(1)) == Echo(1)
        session = server.sessions[client.id]
        client_task.cancel()  # the client process dies and never comes back
        await until(lambda: session.state is State.DOWN)
        await until(lambda: client.id not in server.sessions, timeout=2)
        assert session.down_since is not None
        forgotten_after = loop.time() - session.down_since
        # The reaper looks every linger_s / 4.
        assert cfg.linger_s <= forgotten_after <= cfg.linger_s + cfg.linger_s / 4 + 0.3
        assert session.finished
        await server.close()
