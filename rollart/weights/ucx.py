"""The UCX transport: a `Connection` over a ucxx endpoint, so a weight push speaks the same frames on both.

    conn = await open_ucx(host, ucx_port, local=identity, secret=secret, cfg=cfg)    # publisher
    listener = await listen_ucx(on_connection, port=0)                                # receiver

Frames are tagged UCX messages: an 8-byte big-endian header (bit 63 set for a bulk frame, the
low bits the length), then the body as a second message, which UCX delivers straight into the
buffer the receiver posted (`bulk_sink`), by rendezvous for anything over 8 KiB. Authentication
is the TCP handshake itself (`rollart.protocol.auth`), run over these frames: until it passes,
frames are capped at `PREAUTH_FRAME_BYTES` and bulk frames are refused, so a stranger can make
the receiver allocate nothing big.

Process-wide state: ucxx has one context per process. We start it in "thread" progress mode with
Python futures, so a receiver idling on an endpoint costs no CPU (the default mode spins the event
loop: a whole core on a 2-core machine, measured). That mode binds the context to one event loop and
runs two threads: UCX's progress thread (C++), which runs every UCX callback, and a non-daemon
notifier thread that would block interpreter exit. `_Runtime` counts users and shuts the context
down after the last one, in this order:

1. the users have closed their endpoints (`UcxConnection.close` + `wait_closed`);
2. the progress thread stops, so no UCX callback runs after this; then the notifier thread;
3. only then are retired listeners let go (`retire`). ucxx frees a listener's Python callback data
   with its Python object, but the UCX listener lives on while any endpoint accepted from it does;
   while the progress thread runs, a connection request in that window (a trainer reconnecting to
   a draining generator) ran the callback on freed memory: SIGSEGV in the progress thread
   (issue 17, benchmarks/ucx_teardown.py);
4. `ucxx.reset()`, which fails (logged) while something still holds an endpoint; harmless after 2.

At interpreter exit the threads are stopped in any case (threading's exit hooks run before
non-daemon threads are joined; atexit's after).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import os
import struct
import threading
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import structlog

from rollart.protocol.auth import Identity, client_handshake
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, FrameTooLarge, ProtocolError
from rollart.protocol.frames import Bulk, FrameReceiver
from rollart.protocol.framing import BulkSink
from rollart.weights.wire import TransportUnavailable

log = structlog.get_logger("rollart.weights.ucx")

_HEADER = struct.Struct(">Q")
_BULK_BIT = 1 << 63
PREAUTH_FRAME_BYTES = 64 * 1024
"""Largest message frame accepted before the handshake has passed (a Hello is ~150 bytes)."""
_CLOSE_GRACE_S = 2.0  # queued frames (a Refuse, an ack) get this long to leave before an abort

_ENV_DEFAULTS = {
    "UCX_RNDV_FRAG_MEM_TYPE": "host",  # ucxx defaults it to cuda, which fails on a machine without one
    "UCX_TLS": "tcp,sm,self",
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer reads
    # A receiver restarted on its fixed port could not listen while the last connection to the old one
    # sat in TIME_WAIT (UCXXBusyError "Device is busy"): let the listener reuse the address.
    "UCX_CM_REUSEADDR": "y",
}


def import_ucxx() -> Any:
    """The `ucxx` module, environment set first; `TransportUnavailable` saying why when it cannot load."""
    for name, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        return importlib.import_module("ucxx")
    except Exception as exc:  # ImportError, or a broken native library (OSError, RuntimeError)
        raise TransportUnavailable(f"ucxx cannot be imported: {type(exc).__name__}: {exc}") from exc


def ucx_unavailable() -> str | None:
    """None when the UCX transport can be used here, else the reason."""
    try:
        import_ucxx()
    except TransportUnavailable as exc:
        return str(exc)
    return None


class _Runtime:
    """The process's ucxx context: started for the first user, shut down after the last (module docstring)."""

    def __init__(self) -> None:
        self.users = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._exit_hook = False
        self._retired: list[Any] = []

    def acquire(self) -> Any:
        ucxx = import_ucxx()
        loop = asyncio.get_running_loop()
        if self.users and loop is not self.loop:
            raise TransportUnavailable("ucxx is in use by another event loop of this process; one loop at a time")
        if not self.users:
            ucxx.init(progress_mode="thread", enable_python_future=True)
            self.loop = loop
            if not self._exit_hook:
                # threading's own exit hooks run before non-daemon threads are joined; atexit runs after.
                threading._register_atexit(_stop_threads)  # type: ignore[attr-defined]
                self._exit_hook = True
        self.users += 1
        return ucxx

    def retire(self, listener: Any) -> None:
        """Keep a ucxx listener nobody takes connections from any more until the progress thread has
        stopped (after the last user's `release`); closing it earlier frees the data its callback uses."""
        self._retired.append(listener)

    def release(self) -> None:
        self.users -= 1
        if self.users:
            return
        self.loop = None
        ucxx = import_ucxx()
        _stop_threads()
        for listener in self._retired:
            listener.close()
        self._retired.clear()
        try:
            ucxx.reset()  # checks that nothing still uses the context, then lets it go
        except Exception as exc:  # UCXError: an endpoint is still referenced; the next init starts afresh
            log.warning("ucx.reset_incomplete", error=str(exc))


def _stop_threads() -> None:
    """Stop UCX's progress thread (no UCX callback runs after this), then ucxx's notifier thread.

    Progress first: stopping the notifier takes up to a second (it wakes once a second to look for
    the request), and while the progress thread ran on, a connection request could still start a
    handshake on a listener about to be let go."""
    ucxx = import_ucxx()
    # ucxx stops the progress thread only when `reset()` finds the context unreferenced; there is no
    # public call for it, so reach the worker the way reset() does.
    context = ucxx.core._ctx
    if context is not None:
        context.worker.stop_progress_thread()
    ucxx.stop_notifier_thread()


RUNTIME = _Runtime()


class UcxConnection(FrameReceiver):
    """`rollart.protocol.framing.Connection` over a ucxx endpoint.

    One reader task posts receives (into `bulk_sink` for bulk frames) and queues what arrives; one
    writer task sends queued frames in order. Both belong to the connection and end with it."""

    def __init__(self, ep: Any, peer: str, *, max_frame_bytes: int, max_bulk_bytes: int) -> None:
        self._ep = ep
        self._peer = peer
        self.max_frame_bytes = min(max_frame_bytes, PREAUTH_FRAME_BYTES)
        self.max_bulk_bytes = 0
        self._limits = (max_frame_bytes, max_bulk_bytes)
        self.bulk_sink: BulkSink | None = None
        self._loop = asyncio.get_running_loop()
        self._frames: collections.deque[bytes | Bulk] = collections.deque()
        self._arrival = asyncio.Event()
        self._error: BaseException | None = None
        # (header, body, done): a header of None is a marker that only resolves `done` (drain)
        self._out: asyncio.Queue[tuple[bytes | None, memoryview | bytes | None, asyncio.Future[None] | None] | None]
        self._out = asyncio.Queue()
        self._closing = False
        self._reader = asyncio.create_task(self._read(), name=f"ucx-read {peer}")
        self._writer = asyncio.create_task(self._write(), name=f"ucx-write {peer}")

    def authenticated(self) -> None:
        """The handshake passed: lift the pre-authentication limits."""
        self.max_frame_bytes, self.max_bulk_bytes = self._limits

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closing or self._error is not None

    @property
    def tls(self) -> None:
        """UCX does not encrypt: a topology with `run.tls` sends weights over TLS on TCP instead."""
        return None

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._arrival.set()

    async def _read(self) -> None:
        header = bytearray(_HEADER.size)
        try:
            while True:
                await self._ep.recv(header)
                (word,) = _HEADER.unpack(header)
                nbytes = word & ~_BULK_BIT
                if word & _BULK_BIT:
                    if nbytes > self.max_bulk_bytes:
                        raise FrameTooLarge(f"bulk frame of {nbytes} bytes exceeds the limit of {self.max_bulk_bytes}")
                    dest = self.bulk_sink(nbytes) if self.bulk_sink else memoryview(bytearray(nbytes))
                    if len(dest) != nbytes:
                        raise ProtocolError(f"bulk sink gave {len(dest)} bytes for a {nbytes}-byte frame")
                    if nbytes:
                        await self._ep.recv(dest)
                    self._frames.append(Bulk(dest))
                    del dest  # held only by the frame now: a pooled buffer is free once its tensors are
                else:
                    if nbytes > self.max_frame_bytes:
                        raise FrameTooLarge(f"frame of {nbytes} bytes exceeds the limit of {self.max_frame_bytes}")
                    body = bytearray(nbytes)
                    if nbytes:
                        await self._ep.recv(body)
                    self._frames.append(bytes(body))
                self._arrival.set()
        except ProtocolError as exc:
            self._fail(exc)
        except Exception as exc:  # ucxx raises its own hierarchy (UCXXError) and ValueError for bad buffers
            self._fail(ConnectionClosed(f"UCX connection to {self._peer} closed: {type(exc).__name__}: {exc}"))

    async def _write(self) -> None:
        pending: asyncio.Future[None] | None = None
        try:
            while (item := await self._out.get()) is not None:
                header, body, pending = item
                if header is not None:
                    await self._ep.send(header)
                if body is not None and len(body):
                    await self._ep.send(body)
                if pending is not None and not pending.done():
                    pending.set_result(None)
                pending = None
        except Exception as exc:  # see _read
            error = ConnectionClosed(f"UCX connection to {self._peer} closed: {type(exc).__name__}: {exc}")
            self._fail(error)
            for future in [pending] + [i[2] for i in self._drain_queue() if i is not None]:
                if future is not None and not future.done():
                    future.set_exception(error)
        finally:
            self._reader.cancel()
            await self._ep.close()

    def _drain_queue(self) -> list[Any]:
        items = []
        while not self._out.empty():
            items.append(self._out.get_nowait())
        return items

    def _check_open(self) -> None:
        if self.closed:
            raise self._error or ConnectionClosed(f"UCX connection to {self._peer} closed")

    def send(self, frame: bytes) -> None:
        self._check_open()
        if len(frame) > self._limits[0]:
            raise FrameTooLarge(f"refusing to send a {len(frame)}-byte frame (limit {self._limits[0]})")
        self._out.put_nowait((_HEADER.pack(len(frame)), frame, None))

    async def send_bulk(self, payload: bytes | bytearray | memoryview) -> None:
        self._check_open()
        view = memoryview(payload).cast("B")
        done: asyncio.Future[None] = self._loop.create_future()
        self._out.put_nowait((_HEADER.pack(_BULK_BIT | len(view)), view, done))
        await done

    async def drain(self) -> None:
        self._check_open()
        done: asyncio.Future[None] = self._loop.create_future()
        self._out.put_nowait((None, None, done))
        await done

    async def _next(self) -> bytes | Bulk:
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._arrival.clear()
            await self._arrival.wait()
        return self._frames.popleft()

    async def recv_batch(self) -> list[bytes]:
        return [await self.recv()]

    def close(self) -> None:
        """Send what is queued (for at most `_CLOSE_GRACE_S`), then close the endpoint."""
        if self._closing:
            return
        self._closing = True
        self._fail(ConnectionClosed(f"UCX connection to {self._peer} closed"))
        self._out.put_nowait(None)
        self._loop.call_later(_CLOSE_GRACE_S, self._writer.cancel)

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._writer)


async def open_ucx(host: str, port: int, *, local: Identity, secret: bytes, cfg: SessionConfig) -> UcxConnection:
    """Connect to a receiver's UCX listener and authenticate, as `open_bulk` does over TCP.

    The caller holds `RUNTIME`. Raises `ConnectionClosed` when nothing listens there,
    `HandshakeRefused` (wrong secret, ...), `TimeoutError`."""
    ucxx = import_ucxx()
    timeout = cfg.handshake_timeout_s
    try:
        async with asyncio.timeout(timeout):
            ep = await ucxx.create_endpoint(host, port, connect_timeout=timeout)
    except (TimeoutError, asyncio.CancelledError) as exc:  # cancelled: by `WeightPublisher.close`, say
        _forget_frames(exc)
        raise
    except Exception as exc:  # ucxx's own errors: the peer is not there
        _forget_frames(exc)
        raise ConnectionClosed(f"UCX connect to {host}:{port} failed: {type(exc).__name__}: {exc}") from exc
    conn = UcxConnection(
        ep, f"ucx://{host}:{port}", max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes
    )
    try:
        session_id = f"bulk-{uuid.uuid4().hex}"
        await client_handshake(
            conn, identity=local, secret=secret, session_id=session_id, purpose="bulk", timeout=timeout
        )
    except BaseException:
        conn.close()
        raise
    conn.authenticated()
    return conn


def _forget_frames(exc: BaseException) -> None:
    """Clear the locals of the frames an error of `create_endpoint` (and the errors it chains) passed
    through: every one of them has finished but `open_ucx`'s own, which `traceback.clear_frames` skips.

    The traceback holds `create_endpoint`'s frame, whose locals hold the endpoint being created and
    the ucxx context. ucxx keeps a request's error on the request's future, which the C++ request
    holds, and the endpoint holds the request: a cycle through C++ that Python's collector cannot
    see; a cancelled push task keeps its error too. Without this every failed or cancelled connect
    (to a generator killed or restarting) kept an endpoint and the context, and `ucxx.reset()` failed."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def listen_ucx(on_endpoint: Callable[[Any], None], *, port: int = 0, timeout: float = 5.0) -> Any:
    """Start a ucxx listener on all interfaces (`port` 0: any free one); keep the result to keep listening."""
    return import_ucxx().create_listener(on_endpoint, port=port, connect_timeout=timeout)
