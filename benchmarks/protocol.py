"""Protocol benchmark: what RollArt's wire layers cost next to plain TCP, on loopback.

Run from the repository root (a full run takes about a minute and a half):

    .venv/bin/python benchmarks/protocol.py            # full run, writes benchmarks/results/protocol.md
    .venv/bin/python benchmarks/protocol.py --quick    # smaller N, a smoke run
    .venv/bin/python benchmarks/protocol.py --out /tmp/protocol.md

Every message is the CONTROL channel's `Echo(n, data=<32 bytes>)`. What is measured:

- (a) msgspec alone, in one process: encode the `Echo`, wrap it in a session `Msg` envelope and
  encode that; then decode the envelope and the `Echo` with the typed channel decoders.
- (b) one-way framed messages over TCP to a receiver process that decodes each `Echo`:
  (b1) textbook asyncio streams (4-byte length prefix, `writer.write` with a `drain` every
  64 messages, `readexactly` on the reader); (b2) RollArt's framing alone (`open_tcp` /
  `serve_tcp`, `TcpConnection.send` / `recv`, same drain period).
- (c) the session layer, `ClientSession` -> `SessionServer` after the HMAC handshake:
  one-way events (`await session.send(Echo(...))`), and request/response round trips,
  (c1) one at a time and (c2) 64 in flight.
- (d) one 64 MiB payload: `open_bulk` + `send_blob` to a server whose `on_bulk` does
  `recv_blob` and answers with a small frame, next to asyncio streams (`writer.write` of the
  whole payload + `drain`, the receiver `readexactly(64 MiB)` and a one-byte answer).

Every receiver runs in its own process (multiprocessing, 'spawn'); both ends run uvloop. A
rate is items / time from the sender's first byte to the receiver's answer saying it has
everything (one extra round trip, microseconds). Each measurement does a warm-up round, then
3 rounds of a fixed N (5 for bulk), and reports the median round; the table shows every round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import multiprocessing
import os
import platform
import shlex
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import version
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import msgspec
import structlog
import uvloop

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
from rollart.protocol.errors import ConnectionClosed
from rollart.protocol.framing import serve_tcp
from rollart.protocol.messages import SESSION, Echo, Kind, Msg

HOST = "127.0.0.1"
DATA = bytes(range(32))  # the Echo payload: 32 bytes
DRAIN_EVERY = 64  # plain-TCP senders await drain() once per this many messages
IN_FLIGHT = 64  # concurrent requests in (c2)
COUNT_QUERY = -1  # Echo(n=COUNT_QUERY) asks the session server how many events it has handled
_LEN = struct.Struct(">I")
_U64 = struct.Struct(">Q")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "protocol.md"


@dataclass(frozen=True)
class Sizes:
    """Items per measured round (sized for ~1-3 s each on a 2-core machine), and repetitions."""

    codec: int
    oneway: int
    session_oneway: int
    rtt_sequential: int
    rtt_pipelined: int
    bulk_bytes: int
    rounds: int
    bulk_rounds: int


FULL = Sizes(
    codec=1_000_000,
    oneway=500_000,
    session_oneway=300_000,
    rtt_sequential=30_000,
    rtt_pipelined=150_000,
    bulk_bytes=64 * 1024**2,
    rounds=3,
    bulk_rounds=5,
)
QUICK = Sizes(
    codec=100_000,
    oneway=50_000,
    session_oneway=30_000,
    rtt_sequential=3_000,
    rtt_pipelined=15_000,
    bulk_bytes=64 * 1024**2,
    rounds=3,
    bulk_rounds=3,
)


@dataclass
class Result:
    key: str
    what: str
    unit: str
    n: int  # items per round
    rates: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def quiet_logs() -> None:
    """Drop the protocol's info-level logs: formatting them would be part of what is timed."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


async def measure(result: Result, rounds: int, run_round: Callable[[int], Awaitable[float]]) -> Result:
    """One warm-up round (a tenth of N), then `rounds` rounds of N; `run_round(n)` returns seconds."""
    await run_round(max(1, result.n // 10))
    for _ in range(rounds):
        seconds = await run_round(result.n)
        result.rates.append(result.n / seconds)
    return result


# -- (a) msgspec alone ---------------------------------------------------------------------------


def bench_codec(sizes: Sizes) -> list[Result]:
    encode_body, decode_body = CONTROL.encode, CONTROL.decode
    encode_frame, decode_frame = SESSION.encode, SESSION.decode
    raw, event = msgspec.Raw, Kind.EVENT

    def encode_round(n: int) -> tuple[float, list[bytes]]:
        frames = []
        t0 = time.perf_counter()
        for i in range(n):
            frames.append(encode_frame(Msg(i, i, event, 0, 0, raw(encode_body(Echo(i, DATA))))))
        return time.perf_counter() - t0, frames

    def decode_round(frames: list[bytes]) -> float:
        t0 = time.perf_counter()
        for frame in frames:
            msg = decode_frame(frame)
            decode_body(msg.body)  # type: ignore[union-attr]
        return time.perf_counter() - t0

    enc = Result("a.enc", "msgspec encode (Echo in Msg envelope)", "msg/s", sizes.codec)
    dec = Result("a.dec", "msgspec typed decode (envelope + Echo)", "msg/s", sizes.codec)
    both = Result("a", "msgspec encode + decode", "msg/s", sizes.codec)
    decode_round(encode_round(sizes.codec // 10)[1])  # warm-up
    for _ in range(sizes.rounds):
        enc_s, frames = encode_round(sizes.codec)
        dec_s = decode_round(frames)
        enc.rates.append(sizes.codec / enc_s)
        dec.rates.append(sizes.codec / dec_s)
        both.rates.append(sizes.codec / (enc_s + dec_s))
    return [both, enc, dec]


# -- receivers, one process each -----------------------------------------------------------------


class CountingHandler:
    """Counts events; answers Echo(COUNT_QUERY) with the count so far (and resets it), echoes the rest."""

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
    """(b1): rounds of [u64 N] + N Echo frames; answers each round with a 1-byte frame."""
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
    """(d) baseline: rounds of [u64 N] + N raw bytes; answers each with one byte."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            (n,) = _U64.unpack(await reader.readexactly(8))
            payload = await reader.readexactly(n)
            del payload
            writer.write(b"k")
            await writer.drain()
    writer.close()


async def framing_receiver(conn: Connection) -> None:
    """(b2): the same rounds as `streams_receiver`, over RollArt's framing."""
    decode = CONTROL.decode
    with contextlib.suppress(ConnectionClosed):
        while True:
            (n,) = _U64.unpack(await conn.recv())
            for _ in range(n):
                decode(await conn.recv())
            conn.send(b"k")
    conn.close()


async def bulk_receiver(conn: Connection, peer: Identity) -> None:
    """(d): the session server's `on_bulk`: receive blobs, answer each with a small frame."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            _header, payload = await recv_blob(conn)
            del payload
            conn.send(b"ok")


async def serve_child(kind: str, pipe: Pipe, secret: bytes) -> None:
    """Listen on a free port, send it to the parent, serve until the parent closes the pipe."""
    loop = asyncio.get_running_loop()
    parent_gone = asyncio.Event()
    loop.add_reader(pipe.fileno(), parent_gone.set)  # readable only at EOF: the parent closed it or died
    try:
        await _serve_until(kind, pipe, secret, parent_gone)
    except* _Stop:
        pass
    loop.remove_reader(pipe.fileno())


class _Stop(Exception):
    """Raised in the receiver's task group to cancel every task in it."""


async def _serve_until(kind: str, pipe: Pipe, secret: bytes, stop: asyncio.Event) -> None:
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
                HOST,
                0,
                on_connection,
                max_frame_bytes=cfg.max_frame_bytes,
                max_bulk_bytes=cfg.max_bulk_bytes,
            )
        elif kind == "session":
            session_server = SessionServer(
                local=Identity("bench-server", "bench"),
                secret=secret,
                channel=CONTROL,
                handler=CountingHandler(),
                cfg=SessionConfig(),
                on_bulk=bulk_receiver,
            )
            tg.create_task(session_server.serve())
            server = await session_server.listen_tcp(HOST, 0)
        else:
            raise ValueError(f"unknown receiver kind {kind!r}")
        pipe.send(server.sockets[0].getsockname()[1])
        await stop.wait()
        server.close()
        raise _Stop  # cancels the connection and session tasks


def child_main(kind: str, pipe: Pipe, secret: bytes) -> None:
    quiet_logs()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the whole process group
        uvloop.run(serve_child(kind, pipe, secret))


@contextlib.contextmanager
def receiver(kind: str, secret: bytes = b"") -> Iterator[int]:
    """Start a receiver process; yield its port; stop it on the way out, whatever happened."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=child_main, args=(kind, theirs, secret), name=f"bench-{kind}", daemon=True)
    proc.start()
    theirs.close()
    try:
        if not ours.poll(30):
            raise RuntimeError(f"{kind} receiver did not report its port within 30 s (exit code {proc.exitcode})")
        yield ours.recv()
    finally:
        ours.close()  # the child sees EOF and shuts down
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


# -- (b) plain framed TCP ------------------------------------------------------------------------


async def bench_streams_oneway(port: int, sizes: Sizes) -> Result:
    reader, writer = await asyncio.open_connection(HOST, port)
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

    try:
        return await measure(
            Result("b1", "plain TCP one-way, asyncio streams", "msg/s", sizes.oneway), sizes.rounds, run_round
        )
    finally:
        writer.close()


async def bench_framing_oneway(port: int, sizes: Sizes) -> Result:
    cfg = SessionConfig()
    conn = await open_tcp(HOST, port, max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes, timeout=5)
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

    try:
        return await measure(
            Result("b2", "plain TCP one-way, RollArt framing", "msg/s", sizes.oneway), sizes.rounds, run_round
        )
    finally:
        conn.close()


# -- (c) sessions --------------------------------------------------------------------------------


async def bench_session(port: int, secret: bytes, sizes: Sizes) -> list[Result]:
    cfg = SessionConfig()
    client = ClientSession(
        lambda: tcp_connector(HOST, port, cfg),
        secret=secret,
        local=Identity("bench-client", "bench"),
        channel=CONTROL,
        cfg=cfg,
        peer_name="bench-server",
    )

    async def oneway_round(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await client.send(Echo(i, DATA))
        reply = await client.request(Echo(COUNT_QUERY), timeout=60)
        seconds = time.perf_counter() - t0
        if reply.n != n:
            raise RuntimeError(f"session server handled {reply.n} events; {n} were sent")
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

    async with asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        async with asyncio.timeout(10):
            await client.up.wait()
        results = [
            await measure(
                Result("c", "session one-way events", "msg/s", sizes.session_oneway), sizes.rounds, oneway_round
            ),
            await measure(
                Result("c1", "session request/response, sequential", "rt/s", sizes.rtt_sequential),
                sizes.rounds,
                sequential_round,
            ),
            await measure(
                Result("c2", f"session request/response, {IN_FLIGHT} in flight", "rt/s", sizes.rtt_pipelined),
                sizes.rounds,
                pipelined_round,
            ),
        ]
        await client.close()
    return results


# -- (d) bulk ------------------------------------------------------------------------------------


def gib_per_s(result: Result) -> Result:
    """Turn payloads/s into GiB/s."""
    result.rates = [rate * result.n / 1024**3 for rate in result.rates]
    return result


async def bench_bulk(port: int, secret: bytes, sizes: Sizes, payload: bytes) -> Result:
    conn = await open_bulk(HOST, port, local=Identity("bench-client", "bench"), secret=secret, cfg=SessionConfig())

    async def run_round(n: int) -> float:
        t0 = time.perf_counter()
        await send_blob(conn, "payload", payload)
        await conn.recv()
        return time.perf_counter() - t0

    mib = sizes.bulk_bytes // 1024**2
    try:
        result = Result("d", f"bulk {mib} MiB, open_bulk + send_blob", "GiB/s", sizes.bulk_bytes)
        return gib_per_s(await measure_payloads(result, sizes.bulk_rounds, run_round))
    finally:
        conn.close()


async def bench_streams_bulk(port: int, sizes: Sizes, payload: bytes) -> Result:
    reader, writer = await asyncio.open_connection(HOST, port)

    async def run_round(n: int) -> float:
        t0 = time.perf_counter()
        writer.write(_U64.pack(len(payload)))
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(1)
        return time.perf_counter() - t0

    mib = sizes.bulk_bytes // 1024**2
    try:
        result = Result("d0", f"plain TCP {mib} MiB, asyncio streams", "GiB/s", sizes.bulk_bytes)
        return gib_per_s(await measure_payloads(result, sizes.bulk_rounds, run_round))
    finally:
        writer.close()


async def measure_payloads(result: Result, rounds: int, run_round: Callable[[int], Awaitable[float]]) -> Result:
    """Like `measure`, but a round is one whole payload: rates are payloads/s."""
    await run_round(1)
    for _ in range(rounds):
        result.rates.append(1 / await run_round(1))
    return result


# -- report --------------------------------------------------------------------------------------


def fmt(rate: float, unit: str) -> str:
    return f"{rate:,.2f}" if unit == "GiB/s" else f"{rate:,.0f}"


def table(results: list[Result]) -> list[str]:
    lines = [
        "| id | what | N per round | median | unit | rounds |",
        "|---|---|---:|---:|---|---|",
    ]
    for r in results:
        n = f"{r.n // 1024**2} MiB" if r.unit == "GiB/s" else f"{r.n:,}"
        rounds = ", ".join(fmt(rate, r.unit) for rate in r.rates)
        lines.append(f"| {r.key} | {r.what} | {n} | {fmt(r.median, r.unit)} | {r.unit} | {rounds} |")
    return lines


def ratios(by_key: dict[str, Result]) -> list[str]:
    session = by_key["c"].median
    lines = []
    for base, name in (("b1", "asyncio streams"), ("b2", "RollArt framing")):
        ratio = session / by_key[base].median
        verdict = "PASS" if ratio >= 0.5 else "FAIL"
        lines.append(
            f"- session one-way (c) / plain framed TCP ({base}, {name}): {ratio:.2f}  {verdict} (target >= 0.5)"
        )
    lines += [
        f"- RollArt framing (b2) / asyncio streams (b1): {by_key['b2'].median / by_key['b1'].median:.2f}",
        f"- session one-way (c) / msgspec encode + decode (a): {session / by_key['a'].median:.2f}",
        f"- bulk (d) / plain TCP (d0): {by_key['d'].median / by_key['d0'].median:.2f}",
    ]
    return lines


def machine() -> str:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"nproc {len(os.sched_getaffinity(0))} ({model}), {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, uvloop {version('uvloop')}, msgspec {version('msgspec')}, "
        f"structlog {version('structlog')}; load average at start {load}"
    )


def report(results: list[Result], started: datetime.datetime, host: str, seconds: float) -> str:
    by_key = {r.key: r for r in results}
    return "\n".join(
        [
            "# Protocol benchmark",
            "",
            f"- date: {started.isoformat(timespec='seconds')}",
            f"- machine: {host}",
            f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root; took {seconds:.0f} s)",
            "- every rate is the median of the rounds (all shown); bulk rounds are one payload each",
            "",
            *table(results),
            "",
            "Ratios (medians):",
            "",
            *ratios(by_key),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller N: a smoke run of a few seconds each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report file (default {DEFAULT_OUT})")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    quiet_logs()
    started = datetime.datetime.now().astimezone()
    host = machine()
    t_start = time.perf_counter()
    secret = os.urandom(32)
    payload = os.urandom(sizes.bulk_bytes)

    results = bench_codec(sizes)
    with receiver("streams") as port:
        results.append(uvloop.run(bench_streams_oneway(port, sizes)))
    with receiver("framing") as port:
        results.append(uvloop.run(bench_framing_oneway(port, sizes)))
    with receiver("session", secret) as port:
        results += uvloop.run(bench_session(port, secret, sizes))
        results.append(uvloop.run(bench_bulk(port, secret, sizes, payload)))
    with receiver("streams-bulk") as port:
        results.append(uvloop.run(bench_streams_bulk(port, sizes, payload)))

    text = report(results, started, host, time.perf_counter() - t_start)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
