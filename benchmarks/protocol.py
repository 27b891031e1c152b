"""Protocol benchmark: what RollArt's wire layers cost next to plain TCP, on loopback.

Run from the repository root (a full run takes about 70 s):

    .venv/bin/python benchmarks/protocol.py            # full run, writes benchmarks/results/protocol.md
    .venv/bin/python benchmarks/protocol.py --quick    # a tenth of N: a smoke run
    .venv/bin/python benchmarks/protocol.py --out /tmp/protocol.md

Every message is the CONTROL channel's `Echo(n, data=<32 bytes>)`. What is measured:

- (a) msgspec alone, in one process: encode the `Echo`, wrap it in a session `Msg` envelope and
  encode that; then decode the envelope and the `Echo` with the typed channel decoders.
- (b) one-way framed messages over TCP to a receiver process that decodes each `Echo`:
  (b1) textbook asyncio streams (4-byte length prefix, `writer.write` with a `drain` every
  64 messages, `readexactly` on the reader); (b2) RollArt's framing alone (`open_tcp` /
  `serve_tcp`, `TcpConnection.send` / `recv`, the same drain period). For reference to (c1):
  (b3) sequential request/response over RollArt's framing, the receiver echoing each `Echo`.
- (c) the session layer, `ClientSession` -> `SessionServer` after the HMAC handshake:
  one-way events (`await session.send(Echo(...))`, then one request whose answer is the count
  the server's handler saw), and request/response round trips, (c1) one at a time and
  (c2) 64 in flight.
- (c.tls), (d.tls): (c) and (d) with TLS 1.3 and mutual certificates under the session (`run.tls`:
  certificates made by `rollart.protocol.certs` for the run, ECDSA P-256, the cipher OpenSSL picks:
  AES-256-GCM here), interleaved with their plaintext rows; their ratios are the summary line.
- (d) one 256 MiB payload: `open_bulk` + `send_blob` to the session server, whose `on_bulk` does
  `recv_blob` into a reused buffer and answers with a small frame; (d0) the same over asyncio streams
  (`writer.write` of the whole payload + `drain`; the receiver `readexactly(256 MiB)` and answers
  one byte). Each bulk round also records the CPU time (user + system) it cost the sender's and
  the receiver's process.
- (e.enc), (e.dec): TLS 1.3 record encryption and decryption of one bulk payload in this
  process, through memory BIOs with the nodes' contexts, as asyncio's and uvloop's SSL do it: the
  least work TLS adds to each side of (d.tls). With (d)'s CPU per side it gives the best
  (d.tls)/(d) this machine allows, printed under the table.
- (f), (f.tls), (f.tls2): the same payload with no RollArt code and no event loop: Python's blocking
  sockets, `sendall` in 1 MiB pieces and `recv_into` a reused destination; (f.tls) through `ssl.SSLSocket`
  (OpenSSL reads and decrypts each record itself), (f.tls2) striped over two TLS connections, one
  thread per connection on each side (OpenSSL runs without the GIL). What TLS costs bulk here
  whatever the code around it, and whether a second core's worth of threads buys it back.

Every receiver runs in its own process (multiprocessing, 'spawn'); both ends run uvloop. A
rate is items / time from the sender's first byte to the receiver's answer saying it has
everything (so it includes one round trip, microseconds). Each measurement has a warm-up round
(a tenth of N; one payload for bulk), then 3 rounds of a fixed N (7 payloads for bulk); the
report gives the median round and shows every round. Rounds of (b1), (b2), (c), (c1), (c2)
are interleaved, as are (d) and (d0), so that load from other jobs on the machine falls on
each side of a ratio alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import os
import resource
import shlex
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import msgspec
import structlog
import uvloop
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script

from rollart.protocol import (
    CONTROL,
    ClientSession,
    Connection,
    Identity,
    Session,
    SessionConfig,
    SessionServer,
    open_bulk,
    open_tcp,
    recv_blob,
    send_blob,
    tcp_connector,
)
from rollart.protocol.certs import NodeName, issue_for_nodes
from rollart.protocol.errors import ConnectionClosed
from rollart.protocol.framing import TcpConnection, serve_tcp
from rollart.protocol.messages import SESSION, Echo, Kind, Msg
from rollart.protocol.tls import NodeTls

HOST = "127.0.0.1"
DATA = bytes(range(32))  # the Echo payload
DRAIN_EVERY = 64  # plain-TCP senders await drain() once per this many messages
IN_FLIGHT = 64  # concurrent requests in (c2)
ECHO_ROUND = b"echo"  # (b3) round header prefix
COUNT_QUERY = -1  # Echo(n=COUNT_QUERY) asks the session server how many events it has handled
CODEC_CHUNK = 10_000  # (a) encodes this many frames, then decodes them: bounded memory
GIB = 1024**3
_LEN = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")
BULK_CHUNK = 1024**2  # (e) hands the TLS object this much at a time
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "protocol.md"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Items per round, sized for 1-3 s a round on a 2-core machine; and how many rounds."""

    codec: int = 2_000_000
    streams_oneway: int = 250_000
    framing_oneway: int = 2_500_000
    framing_rtt: int = 20_000
    session_oneway: int = 600_000
    rtt_sequential: int = 12_000
    rtt_pipelined: int = 80_000
    bulk_bytes: int = 256 * 1024**2
    rounds: int = 3
    bulk_rounds: int = 7

    def quick(self) -> Sizes:
        counts = (
            "codec",
            "streams_oneway",
            "framing_oneway",
            "framing_rtt",
            "session_oneway",
            "rtt_sequential",
            "rtt_pipelined",
        )
        return dataclasses.replace(self, bulk_rounds=3, **{name: getattr(self, name) // 10 for name in counts})


@dataclasses.dataclass
class Result:
    key: str
    what: str
    unit: str  # "msg/s", "rt/s" or "GiB/s"
    n: int  # items per round (bytes for GiB/s)
    rates: list[float] = dataclasses.field(default_factory=list)
    # bulk rows: CPU seconds (user + system) each round cost the sender and the receiver process
    sender_cpu: list[float] = dataclasses.field(default_factory=list)
    receiver_cpu: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def add(self, seconds: float) -> None:
        self.rates.append(self.n / seconds / (GIB if self.unit == "GiB/s" else 1))


@dataclasses.dataclass
class Bench:
    """One measurement: `run_round(n)` sends n items (or one payload) and returns the seconds."""

    result: Result
    run_round: Callable[[int], Awaitable[float]]
    warmup_n: int


def cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def quiet_logs() -> None:
    """Drop the protocol's info-level logs: formatting them would be part of what is timed."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


async def run_interleaved(benches: list[Bench], rounds: int) -> None:
    """Warm each up, then run round 1 of each, round 2 of each, ..."""
    for bench in benches:
        await bench.run_round(bench.warmup_n)
        bench.result.sender_cpu.clear()  # a warm-up's CPU figures are dropped with its time
        bench.result.receiver_cpu.clear()
    for _ in range(rounds):
        for bench in benches:
            bench.result.add(await bench.run_round(bench.result.n))


# -- (a) msgspec alone ---------------------------------------------------------------------------


def bench_codec(sizes: Sizes) -> list[Result]:
    encode_body, decode_body = CONTROL.encode, CONTROL.decode
    encode_frame, decode_frame = SESSION.encode, SESSION.decode
    raw, event = msgspec.Raw, Kind.EVENT

    def run_round(n: int) -> tuple[float, float]:
        encode_s = decode_s = 0.0
        for first in range(0, n, CODEC_CHUNK):
            t0 = time.perf_counter()
            frames = [
                encode_frame(Msg(i, i, event, 0, 0, raw(encode_body(Echo(i, DATA)))))
                for i in range(first, min(n, first + CODEC_CHUNK))
            ]
            t1 = time.perf_counter()
            for frame in frames:
                msg = decode_frame(frame)
                decode_body(msg.body)  # type: ignore[union-attr]
            encode_s, decode_s = encode_s + t1 - t0, decode_s + time.perf_counter() - t1
        return encode_s, decode_s

    both = Result("a", "msgspec encode + typed decode, Echo in a Msg envelope", "msg/s", sizes.codec)
    enc = Result("a.enc", "  of which encode (Echo, then Msg)", "msg/s", sizes.codec)
    dec = Result("a.dec", "  of which typed decode (Msg, then Echo)", "msg/s", sizes.codec)
    run_round(sizes.codec // 10)
    for _ in range(sizes.rounds):
        encode_s, decode_s = run_round(sizes.codec)
        both.add(encode_s + decode_s)
        enc.add(encode_s)
        dec.add(decode_s)
    return [both, enc, dec]


# -- receivers, one process each -----------------------------------------------------------------


class CountingHandler:
    """Counts events; answers Echo(COUNT_QUERY) with the count (and resets it); echoes other requests."""

    def __init__(self) -> None:
        self.events = 0

    async def on_event(self, session: Session, msg: Any) -> None:
        self.events += 1

    async def on_request(self, session: Session, msg: Any) -> Any:
        if isinstance(msg, Echo) and msg.n == COUNT_QUERY:
            count, self.events = self.events, 0
            return Echo(count)
        return msg


async def streams_receiver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """(b1): rounds of a frame holding u64 N, then N Echo frames; answers each round with a frame."""
    decode = CONTROL.decode
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            (length,) = _LEN.unpack(await reader.readexactly(4))
            (n,) = _U64.unpack(await reader.readexactly(length))
            for _ in range(n):
                (length,) = _LEN.unpack(await reader.readexactly(4))
                decode(await reader.readexactly(length))
            writer.write(_LEN.pack(1) + b"k")
            await writer.drain()
    writer.close()


async def streams_bulk_receiver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """(d0): rounds of u64 N, then N raw bytes; answers each round with one byte."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            (n,) = _U64.unpack(await reader.readexactly(8))
            payload = await reader.readexactly(n)
            del payload
            writer.write(b"k")
            await writer.drain()
    writer.close()


async def framing_receiver(conn: Connection) -> None:
    """(b2): the rounds of `streams_receiver`, over RollArt's framing; (b3): a round whose first
    frame is `ECHO_ROUND` + u64 N echoes the N frames that follow, one by one."""
    encode, decode = CONTROL.encode, CONTROL.decode
    with contextlib.suppress(ConnectionClosed):
        while True:
            header = await conn.recv()
            (n,) = _U64.unpack_from(header, len(header) - _U64.size)
            if header.startswith(ECHO_ROUND):
                for _ in range(n):
                    conn.send(encode(decode(await conn.recv())))
                continue
            for _ in range(n):
                decode(await conn.recv())
            conn.send(b"k")
    conn.close()


async def bulk_receiver(conn: Connection, peer: Identity) -> None:
    """(d): the session server's `on_bulk`: receive blobs, answer each with the CPU seconds its receipt
    cost this process (nothing else runs here during bulk rounds; waiting costs none). Each payload
    lands in the buffer the last one used, as the weight receiver's `BufferPool` hands them out: a
    new `bytearray` per payload would add its zero-fill (a memset of the whole payload and its page
    faults, about four times the kernel's copy) to the receiver's side of every round."""
    reused: memoryview | None = None

    def sink(nbytes: int) -> memoryview:
        nonlocal reused
        if reused is None or len(reused) != nbytes:
            reused = memoryview(bytearray(nbytes))
        return reused

    assert isinstance(conn, TcpConnection)
    conn.bulk_sink = sink
    with contextlib.suppress(ConnectionClosed):
        while True:
            before = cpu_seconds()
            _header, payload = await recv_blob(conn)
            del payload
            conn.send(_F64.pack(cpu_seconds() - before))


class _Stop(Exception):
    """Raised in a receiver's task group to cancel every task in it."""


def node_tls(certs: str, name: str) -> NodeTls:
    folder = Path(certs)
    return NodeTls(folder / "ca.pem", folder / f"{name}.pem", folder / f"{name}.key")


async def serve(kind: str, pipe: Pipe, secret: bytes, stop: asyncio.Event, certs: str) -> None:
    async with asyncio.TaskGroup() as tg:
        server: asyncio.Server
        if kind == "streams":
            server = await asyncio.start_server(streams_receiver, HOST, 0)
        elif kind == "streams-bulk":
            server = await asyncio.start_server(streams_bulk_receiver, HOST, 0)
        elif kind == "framing":
            cfg = SessionConfig()

            def on_connection(conn: Connection) -> None:
                tg.create_task(framing_receiver(conn))

            server = await serve_tcp(
                HOST, 0, on_connection, max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes
            )
        elif kind in ("session", "session-tls"):
            session_server = SessionServer(
                local=Identity("bench-server", "bench"),
                secret=secret,
                channel=CONTROL,
                handler=CountingHandler(),
                cfg=SessionConfig(),
                on_bulk=bulk_receiver,
                tls=node_tls(certs, "bench-server") if kind == "session-tls" else None,
            )
            tg.create_task(session_server.serve())
            server = await session_server.listen_tcp(HOST, 0)
        else:
            raise ValueError(f"unknown receiver kind {kind!r}")
        pipe.send(server.sockets[0].getsockname()[1])
        await stop.wait()
        server.close()
        raise _Stop  # cancels the connection and session tasks


async def receiver_main(kind: str, pipe: Pipe, secret: bytes, certs: str) -> None:
    """Listen on a free port, send it to the parent, serve until the parent closes the pipe."""
    loop = asyncio.get_running_loop()
    parent_gone = asyncio.Event()
    # The parent never writes again: the pipe turns readable only at EOF (parent closed it or died).
    loop.add_reader(pipe.fileno(), parent_gone.set)
    try:
        await serve(kind, pipe, secret, parent_gone, certs)
    except* _Stop:
        pass
    loop.remove_reader(pipe.fileno())


def child_main(kind: str, pipe: Pipe, secret: bytes, certs: str) -> None:
    quiet_logs()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the whole process group
        uvloop.run(receiver_main(kind, pipe, secret, certs))


@contextlib.contextmanager
def receiver(kind: str, secret: bytes = b"", certs: str = "") -> Iterator[int]:
    """Start a receiver process and yield its port; stop it on the way out, whatever happened."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=child_main, args=(kind, theirs, secret, certs), name=f"bench-{kind}", daemon=True)
    proc.start()
    theirs.close()
    try:
        if not ours.poll(30):
            raise RuntimeError(f"{kind} receiver did not report its port within 30 s (exit code {proc.exitcode})")
        yield ours.recv()
    finally:
        ours.close()  # the child sees EOF and exits
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


# -- senders -------------------------------------------------------------------------------------


async def streams_oneway(port: int, sizes: Sizes, stack: contextlib.AsyncExitStack) -> Bench:
    """(b1)"""
    reader, writer = await asyncio.open_connection(HOST, port)
    stack.callback(writer.close)
    encode = CONTROL.encode

    async def run_round(n: int) -> float:
        t0 = time.perf_counter()
        writer.write(_LEN.pack(8))
        writer.write(_U64.pack(n))
        for i in range(n):
            body = encode(Echo(i, DATA))
            writer.write(_LEN.pack(len(body)))
            writer.write(body)
            if i % DRAIN_EVERY == 0:
                await writer.drain()
        await writer.drain()
        await reader.readexactly(5)
        return time.perf_counter() - t0

    n = sizes.streams_oneway
    return Bench(Result("b1", "plain TCP one-way, asyncio streams", "msg/s", n), run_round, n // 10)


async def framing_oneway(port: int, sizes: Sizes, stack: contextlib.AsyncExitStack) -> Bench:
    """(b2)"""
    cfg = SessionConfig()
    conn = await open_tcp(HOST, port, max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes, timeout=5)
    stack.callback(conn.close)
    encode = CONTROL.encode

    async def run_round(n: int) -> float:
        t0 = time.perf_counter()
        conn.send(_U64.pack(n))
        for i in range(n):
            conn.send(encode(Echo(i, DATA)))
            if i % DRAIN_EVERY == 0:
                await conn.drain()
        await conn.drain()
        await conn.recv()
        return time.perf_counter() - t0

    n = sizes.framing_oneway
    return Bench(Result("b2", "plain TCP one-way, RollArt framing", "msg/s", n), run_round, n // 10)


async def framing_rtt(port: int, sizes: Sizes, stack: contextlib.AsyncExitStack) -> Bench:
    """(b3)"""
    cfg = SessionConfig()
    conn = await open_tcp(HOST, port, max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes, timeout=5)
    stack.callback(conn.close)
    encode, decode = CONTROL.encode, CONTROL.decode

    async def run_round(n: int) -> float:
        t0 = time.perf_counter()
        conn.send(ECHO_ROUND + _U64.pack(n))
        for i in range(n):
            conn.send(encode(Echo(i, DATA)))
            decode(await conn.recv())
        return time.perf_counter() - t0

    n = sizes.framing_rtt
    what = "plain TCP request/response, sequential, RollArt framing"
    return Bench(Result("b3", what, "rt/s", n), run_round, n // 10)


async def session_benches(
    port: int,
    secret: bytes,
    sizes: Sizes,
    tg: asyncio.TaskGroup,
    stack: contextlib.AsyncExitStack,
    *,
    tls: NodeTls | None = None,
) -> list[Bench]:
    """(c), (c1), (c2) over one session; with `tls`, (c.tls) alone."""
    cfg = SessionConfig()
    client = ClientSession(
        lambda: tcp_connector(HOST, port, cfg, tls),
        secret=secret,
        local=Identity("bench-client", "bench"),
        channel=CONTROL,
        cfg=cfg,
        peer_name="bench-server",
    )
    tg.create_task(client.run())
    stack.push_async_callback(client.close)  # then run() returns
    async with asyncio.timeout(10):
        await client.up.wait()

    async def oneway_round(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await client.send(Echo(i, DATA))
        reply = await client.request(Echo(COUNT_QUERY), timeout=60)
        seconds = time.perf_counter() - t0
        if reply.n != n:
            raise RuntimeError(f"the session server handled {reply.n} events; {n} were sent")
        return seconds

    async def sequential_round(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await client.request(Echo(i, DATA), timeout=10)
        return time.perf_counter() - t0

    async def pipelined_round(n: int) -> float:
        async def worker(first: int) -> None:
            for i in range(first, n, IN_FLIGHT):
                await client.request(Echo(i, DATA), timeout=10)

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as workers:
            for first in range(IN_FLIGHT):
                workers.create_task(worker(first))
        return time.perf_counter() - t0

    n1, n2, n3 = sizes.session_oneway, sizes.rtt_sequential, sizes.rtt_pipelined
    if tls is not None:
        return [Bench(Result("c.tls", "session one-way events, TLS 1.3", "msg/s", n1), oneway_round, n1 // 10)]
    return [
        Bench(Result("c", "session one-way events", "msg/s", n1), oneway_round, n1 // 10),
        Bench(Result("c1", "session request/response, sequential", "rt/s", n2), sequential_round, n2 // 10),
        Bench(Result("c2", f"session request/response, {IN_FLIGHT} in flight", "rt/s", n3), pipelined_round, n3 // 10),
    ]


async def bulk(
    port: int, secret: bytes, payload: bytes, stack: contextlib.AsyncExitStack, tls: NodeTls | None = None
) -> Bench:
    """(d); with `tls`, (d.tls)"""
    client = Identity("bench-client", "bench")
    conn = await open_bulk(HOST, port, local=client, secret=secret, cfg=SessionConfig(), tls=tls)
    stack.callback(conn.close)
    what = f"bulk {len(payload) // 1024**2} MiB, open_bulk + send_blob" + (", TLS 1.3" if tls else "")
    result = Result("d.tls" if tls else "d", what, "GiB/s", len(payload))

    async def run_round(_n: int) -> float:
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        await send_blob(conn, "payload", payload)
        (receiver_cpu,) = _F64.unpack(await conn.recv())
        seconds = time.perf_counter() - t0
        result.sender_cpu.append(cpu_seconds() - cpu0)
        result.receiver_cpu.append(receiver_cpu)
        return seconds

    return Bench(result, run_round, 1)


async def streams_bulk(port: int, payload: bytes, stack: contextlib.AsyncExitStack) -> Bench:
    """(d0)"""
    reader, writer = await asyncio.open_connection(HOST, port)
    stack.callback(writer.close)

    async def run_round(_n: int) -> float:
        t0 = time.perf_counter()
        writer.write(_U64.pack(len(payload)))
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(1)
        return time.perf_counter() - t0

    what = f"plain TCP {len(payload) // 1024**2} MiB, asyncio streams"
    return Bench(Result("d0", what, "GiB/s", len(payload)), run_round, 1)


async def run_network(ports: dict[str, int], secret: bytes, sizes: Sizes, certs: str) -> list[Result]:
    payload = os.urandom(sizes.bulk_bytes)
    tls = node_tls(certs, "bench-client")
    async with asyncio.TaskGroup() as tg, contextlib.AsyncExitStack() as stack:
        messages = [
            await streams_oneway(ports["streams"], sizes, stack),
            await framing_oneway(ports["framing"], sizes, stack),
            await framing_rtt(ports["framing"], sizes, stack),
            *await session_benches(ports["session"], secret, sizes, tg, stack),
            *await session_benches(ports["session-tls"], secret, sizes, tg, stack, tls=tls),
        ]
        payloads = [
            await bulk(ports["session"], secret, payload, stack),
            await bulk(ports["session-tls"], secret, payload, stack, tls),
            await streams_bulk(ports["streams-bulk"], payload, stack),
        ]
        await run_interleaved(messages, sizes.rounds)
        await run_interleaved(payloads, sizes.bulk_rounds)
    return [bench.result for bench in [*messages, *payloads]]


# -- (e) TLS record crypto alone ----------------------------------------------------------------


def tls_pair(certs: str) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.SSLObject, ssl.MemoryBIO]:
    """A client and a server `SSLObject` over memory BIOs (as asyncio's and uvloop's SSL use them),
    handshake done: (client, its outgoing BIO, server, its incoming BIO)."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = node_tls(certs, "bench-client").client.wrap_bio(c_in, c_out)
    server = node_tls(certs, "bench-server").server.wrap_bio(s_in, s_out, server_side=True)
    done = {client: False, server: False}
    while not all(done.values()):
        for obj in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                obj.do_handshake()
                done[obj] = True
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    return client, c_out, server, s_in


def bench_tls_records(certs: str, sizes: Sizes) -> list[Result]:
    """(e.enc), (e.dec): TLS 1.3 record encryption and decryption of one bulk payload in this process,
    through memory BIOs with the nodes' contexts: the user-space work TLS adds to each side of (d.tls)."""
    client, c_out, server, s_in = tls_pair(certs)
    payload = memoryview(os.urandom(sizes.bulk_bytes))
    sink = bytearray(sizes.bulk_bytes)
    mib = sizes.bulk_bytes // 1024**2
    enc = Result("e.enc", f"TLS 1.3 record encryption of {mib} MiB in memory (`ssl.MemoryBIO`)", "GiB/s", len(payload))
    dec = Result("e.dec", f"TLS 1.3 record decryption of {mib} MiB in memory (`ssl.MemoryBIO`)", "GiB/s", len(payload))
    for round_ in range(sizes.bulk_rounds + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        records = []
        for start in range(0, len(payload), BULK_CHUNK):
            client.write(payload[start : start + BULK_CHUNK])
            records.append(c_out.read())
        t1 = time.perf_counter()
        got, view = 0, memoryview(sink)
        for chunk in records:
            s_in.write(chunk)
            with contextlib.suppress(ssl.SSLWantReadError):
                while got < len(sink):
                    got += server.read(len(sink) - got, view[got:])
        t2 = time.perf_counter()
        if got != len(sink) or sink[-4096:] != payload[-4096:]:
            raise RuntimeError(f"TLS records decrypted to {got} bytes, not the {len(sink)} encrypted")
        if round_:
            enc.add(t1 - t0)
            dec.add(t2 - t1)
    return [enc, dec]


# -- (f) TLS and plain bulk over blocking sockets, no RollArt code --------------------------------


def _raw_context(certs: str, name: str, *, server: bool) -> ssl.SSLContext:
    tls = node_tls(certs, name)
    return tls.server if server else tls.client


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def _raw_receiver(pipe: Pipe, certs: str, tls: bool, stripes: int, nbytes: int) -> None:
    """(f) receiver: accept `stripes` connections; per payload, each fills its slice of a new buffer
    in its own thread; then answer on the first with the CPU seconds the payload cost this process."""
    listener = socket.create_server((HOST, 0))
    pipe.send(listener.getsockname()[1])
    socks = []
    for _ in range(stripes):
        sock, _addr = listener.accept()
        if tls:
            sock = _raw_context(certs, "bench-server", server=True).wrap_socket(sock, server_side=True)
        socks.append(sock)
    view = memoryview(bytearray(nbytes))  # reused, as (d)'s receiver does
    with contextlib.suppress(ConnectionError):
        while True:
            before = cpu_seconds()
            _striped(_recv_exactly, socks, view)
            socks[0].sendall(_F64.pack(cpu_seconds() - before))


def _striped(work: Callable[[socket.socket, memoryview], None], socks: list[socket.socket], view: memoryview) -> None:
    """`work(sock, its slice of view)` for each socket, each in a thread of its own; returns when all are done."""
    part = len(view) // len(socks)
    threads = [
        threading.Thread(target=work, args=(sock, view[i * part : (i + 1) * part])) for i, sock in enumerate(socks)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _send_slice(sock: socket.socket, view: memoryview) -> None:
    for start in range(0, len(view), BULK_CHUNK):
        sock.sendall(view[start : start + BULK_CHUNK])


def bench_raw_sockets(certs: str, sizes: Sizes) -> list[Result]:
    """(f), (f.tls), (f.tls2): rounds interleaved, each receiver in its own process."""
    payload = memoryview(os.urandom(sizes.bulk_bytes))
    mib = sizes.bulk_bytes // 1024**2
    setups = [
        ("f", False, 1, f"plain TCP {mib} MiB, blocking sockets"),
        ("f.tls", True, 1, f"TLS 1.3 {mib} MiB, blocking `ssl.SSLSocket`"),
        ("f.tls2", True, 2, f"TLS 1.3 {mib} MiB, blocking `ssl.SSLSocket`, 2 connections, a thread each"),
    ]
    ctx = multiprocessing.get_context("spawn")
    benches: list[tuple[Result, list[socket.socket]]] = []
    with contextlib.ExitStack() as stack:
        for key, tls, stripes, what in setups:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_raw_receiver, args=(theirs, certs, tls, stripes, len(payload)), daemon=True)
            proc.start()
            stack.callback(proc.kill)
            if not ours.poll(30):
                raise RuntimeError(f"({key}) receiver did not report its port within 30 s")
            port = ours.recv()
            socks = []
            for _ in range(stripes):
                sock = socket.create_connection((HOST, port))
                if tls:
                    sock = _raw_context(certs, "bench-client", server=False).wrap_socket(sock)
                stack.callback(sock.close)
                socks.append(sock)
            benches.append((Result(key, what, "GiB/s", len(payload)), socks))
        for round_ in range(sizes.bulk_rounds + 1):  # the first is a warm-up
            for result, socks in benches:
                t0, cpu0 = time.perf_counter(), cpu_seconds()
                _striped(_send_slice, socks, payload)
                answer = memoryview(bytearray(_F64.size))
                _recv_exactly(socks[0], answer)
                seconds, sender_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
                if round_:
                    result.add(seconds)
                    result.sender_cpu.append(sender_cpu)
                    result.receiver_cpu.append(_F64.unpack(answer)[0])
    return [result for result, _socks in benches]


# -- report --------------------------------------------------------------------------------------


def fmt(rate: float, unit: str) -> str:
    return f"{rate:,.2f}" if unit == "GiB/s" else f"{rate:,.0f}"


def table(results: list[Result]) -> list[str]:
    lines = ["| id | what | N per round | median | unit | rounds |", "|---|---|---:|---:|---|---|"]
    for r in results:
        n = f"{r.n // 1024**2} MiB" if r.unit == "GiB/s" else f"{r.n:,}"
        rounds = ", ".join(fmt(rate, r.unit) for rate in r.rates)
        lines.append(f"| {r.key} | {r.what} | {n} | {fmt(r.median, r.unit)} | {r.unit} | {rounds} |")
    return lines


def ratios(by_key: dict[str, Result]) -> list[str]:
    def ratio(a: str, b: str) -> float:
        return by_key[a].median / by_key[b].median

    lines = []
    for base, name in (("b1", "asyncio streams"), ("b2", "RollArt framing")):
        verdict = "PASS" if ratio("c", base) >= 0.5 else "FAIL"
        lines.append(
            f"- session one-way (c) / plain framed TCP ({base}, {name}): {ratio('c', base):.2f} "
            f"-> {verdict} against the target >= 0.5"
        )
    lines += [
        f"- RollArt framing (b2) / asyncio streams (b1): {ratio('b2', 'b1'):.2f}",
        f"- session one-way (c) / msgspec encode + decode in one process (a): {ratio('c', 'a'):.2f}",
        f"- session sequential request/response (c1) / plain framed request/response (b3): {ratio('c1', 'b3'):.2f}",
        f"- bulk (d) / plain TCP (d0): {ratio('d', 'd0'):.2f}",
        f"- session one-way over TLS (c.tls) / without (c): {ratio('c.tls', 'c'):.2f}",
        f"- bulk over TLS (d.tls) / without (d): {ratio('d.tls', 'd'):.2f} -> "
        + ("PASS" if ratio("d.tls", "d") >= 0.7 else "FAIL")
        + " against the target >= 0.7",
        f"- with no RollArt code, blocking sockets: TLS (f.tls) / plain (f): {ratio('f.tls', 'f'):.2f}; "
        f"striped over two connections and threads (f.tls2) / plain (f): {ratio('f.tls2', 'f'):.2f}",
    ]
    return lines


def crypto_ceiling(by_key: dict[str, Result]) -> list[str]:
    """What the bulk rows cost each side in CPU, and the best (d.tls)/(d) that TLS's record crypto,
    as measured in (e), leaves possible here."""
    plain, tls = by_key["d"], by_key["d.tls"]
    lines = [
        "CPU seconds per bulk payload, each side in its own process (median of the rounds):",
        "",
        "| id | round | sender CPU | receiver CPU |",
        "|---|---:|---:|---:|",
    ]
    for r in (plain, tls, by_key["f"], by_key["f.tls"], by_key["f.tls2"]):
        round_s = r.n / GIB / r.median
        sender, receiver = statistics.median(r.sender_cpu), statistics.median(r.receiver_cpu)
        lines.append(f"| {r.key} | {round_s:.3f} | {sender:.3f} | {receiver:.3f} |")
    plain_round = plain.n / GIB / plain.median
    encrypt = plain.n / GIB / by_key["e.enc"].median
    decrypt = plain.n / GIB / by_key["e.dec"].median
    sender = statistics.median(plain.sender_cpu) + encrypt
    receiver = statistics.median(plain.receiver_cpu) + decrypt
    floor = max(plain_round, sender, receiver)
    return [
        *lines,
        "",
        f"- TLS adds at least (e)'s record crypto to each side: {encrypt:.3f} s to the sender, {decrypt:.3f} s to "
        f"the receiver. With (d)'s CPU per side, a TLS round cannot be shorter than {floor:.3f} s even with each "
        f"side on its own core and the crypto fully overlapped with the network, so (d.tls)/(d) is at most "
        f"{plain_round / floor:.2f} on this machine.",
    ]


def summary(by_key: dict[str, Result]) -> str:
    """The last line of the report, for scripts: TLS next to plaintext, bulk and messages."""
    bulk = by_key["d.tls"].median / by_key["d"].median
    msgs = by_key["c.tls"].median / by_key["c"].median
    return f"summary: tls_bulk_over_plain={bulk:.2f} tls_msgs_over_plain={msgs:.2f}"


def machine() -> str:
    return describe(["uvloop", "msgspec", "structlog"])


def report(results: list[Result], started: datetime.datetime, host: str, seconds: float) -> str:
    return "\n".join(
        [
            "# Protocol benchmark",
            "",
            f"- date: {started.isoformat(timespec='seconds')}",
            f"- machine: {host}",
            f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root; took {seconds:.0f} s)",
            "- rate: median of the rounds (every round shown); a bulk round is one payload",
            "",
            *table(results),
            "",
            "Ratios of the medians:",
            "",
            *ratios({r.key: r for r in results}),
            "",
            *crypto_ceiling({r.key: r for r in results}),
            "",
            "Until 2026-12-03, (d) and (d.tls) received each 64 MiB payload into a new `bytearray`, whose zero-fill",
            "was most of (d)'s receiver CPU and hid the cost of TLS: bulk over TLS read 0.63 of plaintext. The",
            "weight receiver reuses its buffers (`BufferPool`), and so do these rows now.",
            "",
            summary({r.key: r for r in results}),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of N, 3 bulk rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report file (default {DEFAULT_OUT})")
    args = parser.parse_args()
    sizes = Sizes().quick() if args.quick else Sizes()
    quiet_logs()
    started = datetime.datetime.now().astimezone()
    host = machine()
    t0 = time.perf_counter()
    secret = os.urandom(32)

    results = bench_codec(sizes)
    with contextlib.ExitStack() as stack:
        certs = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollart-bench-certs-"))
        issue_for_nodes(Path(certs), [NodeName("bench-server"), NodeName("bench-client")])
        kinds = ("streams", "framing", "session", "session-tls")
        ports = {kind: stack.enter_context(receiver(kind, secret, certs)) for kind in kinds}
        ports["streams-bulk"] = stack.enter_context(receiver("streams-bulk"))
        results += uvloop.run(run_network(ports, secret, sizes, certs))
        results += bench_tls_records(certs, sizes)
        results += bench_raw_sockets(certs, sizes)

    text = report(results, started, host, time.perf_counter() - t0)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the receivers were stopped on the way out
        sys.exit("interrupted")
