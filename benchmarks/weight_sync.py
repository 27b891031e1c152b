"""Weight-sync benchmark: what a push costs next to plain TCP (and plain UCX), and what the trainer waits for.

Run from the repository root (a full run takes about half a minute):

    .venv/bin/python benchmarks/weight_sync.py            # writes benchmarks/results/weight_sync.md
    .venv/bin/python benchmarks/weight_sync.py --quick    # 2 rounds: a smoke run
    .venv/bin/python benchmarks/weight_sync.py --out /tmp/weight_sync.md

Two state dicts: (a) the tiny default model's (`rollart.tiny.model`, built into a temp
folder and read back from its safetensors, plus the tied `lm_head.weight` the trainer sends), and
(b) 25 tensors of 4 MiB fp32 (100 MiB). Each is pushed by a `WeightPublisher` to a `WeightReceiver`
in another process (spawn; both ends on uvloop) over TCP (`on_bulk` of a `SessionServer`) and over
UCX (ucxx, `listen_ucx`); the receiver's `apply` does nothing, so a push is transfer + checksum +
unpack. Against: the same number of bytes as one blocking `socket.sendall` to a thread doing
`recv_into` one reused buffer (raw TCP), and as one ucxx `send` into one reused buffer (raw UCX).

Per round: `stall` = what `publish()` took (the copy into bucket buffers: all the trainer waits
for), `push` = first byte sent to the receiver's acknowledgement (the publisher's `last_push_s`),
`total` = `publish()` called to `wait_delivered()` returning. A round of a baseline is one payload
to its one-byte answer. There is a warm-up round, then N rounds, interleaved across routes so that
load from other jobs falls on all of them alike; the report gives medians and every round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import multiprocessing
import os
import shlex
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version as pkg_version
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import structlog
import torch
import uvloop
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script

from rollart.protocol import CONTROL, Identity, Session, SessionConfig, SessionServer
from rollart.weights import WeightPublisher, WeightReceiver, ucx, ucx_unavailable

HOST = "127.0.0.1"
SECRET = b"weight sync benchmark"
GENERATOR = Identity("bench-gen", "generator")
TRAINER = Identity("bench-trainer", "trainer")
_U64 = struct.Struct(">Q")
MIB = 1024**2
GIB = 1024**3
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "weight_sync.md"


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


# -- state dicts -----------------------------------------------------------------------------------


def tiny_model_state_dict() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rollart.tiny.model import ensure_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        weights = load_file(str(ensure_tiny_model(Path(tmp) / "tiny") / "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the trainer sends it
    return weights


def big_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(25)}


# -- the receiver process ------------------------------------------------------------------------------


class _NoMessages:
    async def on_event(self, session: Session, msg: Any) -> None: ...

    async def on_request(self, session: Session, msg: Any) -> Any:
        return msg


def raw_tcp_server(listener: socket.socket) -> None:
    """Rounds of u64 N then N bytes into one reused buffer; answers each with one byte."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = memoryview(bytearray(0))
    with conn, contextlib.suppress(ConnectionError):
        while header := conn.recv(_U64.size, socket.MSG_WAITALL):
            (n,) = _U64.unpack(header)
            if len(buffer) != n:
                buffer = memoryview(bytearray(n))
            got = 0
            while got < n:
                if not (chunk := conn.recv_into(buffer[got:])):
                    return
                got += chunk
            conn.sendall(b"k")


async def raw_ucx_server(ep: Any) -> None:
    """The same rounds over one ucxx endpoint, until the parent hangs up (or the task is cancelled)."""
    header, buffer, ack = bytearray(_U64.size), bytearray(0), bytearray(b"k")
    try:
        while True:
            await ep.recv(header)
            (n,) = _U64.unpack(header)
            if len(buffer) != n:
                buffer = bytearray(n)
            await ep.recv(buffer)
            await ep.send(ack)
    except Exception:  # ucxx raises its own errors when the parent hangs up
        return
    finally:
        ep.abort()  # before the receiver resets ucxx, which refuses while an endpoint is alive


async def serve(pipe: Pipe) -> None:
    async def apply(version: int, weights: dict[str, torch.Tensor]) -> None:
        pass

    cfg = SessionConfig()
    receiver = WeightReceiver(apply)
    server = SessionServer(
        local=GENERATOR, secret=SECRET, channel=CONTROL, handler=_NoMessages(), cfg=cfg, on_bulk=receiver.on_bulk
    )
    loop = asyncio.get_running_loop()
    parent_gone = asyncio.Event()
    loop.add_reader(pipe.fileno(), parent_gone.set)  # the parent never writes: readable means EOF
    raw = socket.create_server((HOST, 0))
    threading.Thread(target=raw_tcp_server, args=(raw,), daemon=True).start()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        tg.create_task(receiver.serve())
        listener = await server.listen_tcp(HOST, 0)
        ports = {"tcp": listener.sockets[0].getsockname()[1], "raw-tcp": raw.getsockname()[1]}
        raw_ucx, raw_ucx_tasks = None, []
        if ucx_unavailable() is None:
            ports["ucx"] = await receiver.listen_ucx(local=GENERATOR, secret=SECRET, cfg=cfg)
            raw_ucx = ucx.listen_ucx(lambda ep: raw_ucx_tasks.append(tg.create_task(raw_ucx_server(ep))))
            ports["raw-ucx"] = raw_ucx.port
        pipe.send(ports)
        await parent_gone.wait()
        loop.remove_reader(pipe.fileno())
        if raw_ucx is not None:
            for task in raw_ucx_tasks:
                task.cancel()
            await asyncio.gather(*raw_ucx_tasks, return_exceptions=True)
            ucx.RUNTIME.retire(raw_ucx)  # let go once UCX's progress thread has stopped (rollart/weights/ucx.py)
            del raw_ucx, raw_ucx_tasks
        await receiver.close()
        await server.close()


def child_main(pipe: Pipe) -> None:
    quiet_logs()
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(pipe))


# -- the routes -----------------------------------------------------------------------------------------


Round = tuple[float, float, float]
"""(stall, push, total) seconds."""


class Route:
    """One way of moving a payload: `run(state_dict)` moves it once and returns its `Round`."""

    def __init__(
        self,
        name: str,
        run: Callable[[dict[str, torch.Tensor]], Awaitable[Round]],
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name, self.run, self.close = name, run, close
        self.rounds: dict[str, list[Round]] = {}


class Versions:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:  # one receiver for both publishers: every push must be newer than the last
        self.n += 1
        return self.n


def publisher_route(name: str, publisher: WeightPublisher, versions: Versions) -> Route:
    async def run(weights: dict[str, torch.Tensor]) -> Round:
        version = versions.next()
        t0 = time.perf_counter()
        stall = publisher.publish(version, weights)
        await publisher.wait_delivered(version, timeout=120)
        total = time.perf_counter() - t0
        return stall, publisher.stats()["gen"].last_push_s, total

    return Route(name, run)


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


async def raw_tcp_route(port: int) -> Route:
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payloads: dict[int, bytearray] = {}

    def push(n: int) -> float:
        payload = payloads.setdefault(n, bytearray(os.urandom(16)) * (n // 16) + bytearray(n % 16))
        t0 = time.perf_counter()
        sock.sendall(_U64.pack(n))
        sock.sendall(payload)
        sock.recv(1, socket.MSG_WAITALL)
        return time.perf_counter() - t0

    async def run(weights: dict[str, torch.Tensor]) -> Round:
        seconds = await asyncio.to_thread(push, nbytes(weights))
        return 0.0, seconds, seconds

    async def close() -> None:
        sock.close()

    return Route("raw TCP (sendall into one reused buffer)", run, close)


async def raw_ucx_route(port: int) -> Route:
    ep = await ucx.import_ucxx().create_endpoint(HOST, port)
    payloads: dict[int, bytearray] = {}
    ack = bytearray(1)

    async def run(weights: dict[str, torch.Tensor]) -> Round:
        n = nbytes(weights)
        payload = payloads.setdefault(n, bytearray(os.urandom(16)) * (n // 16) + bytearray(n % 16))
        t0 = time.perf_counter()
        await ep.send(bytearray(_U64.pack(n)))
        await ep.send(payload)
        await ep.recv(ack)
        seconds = time.perf_counter() - t0
        return 0.0, seconds, seconds

    async def close() -> None:
        await ep.close()

    return Route("raw UCX (one ucxx send into one reused buffer)", run, close)


async def measure(ports: dict[str, int], payloads: dict[str, dict[str, torch.Tensor]], rounds: int) -> list[Route]:
    versions = Versions()
    have_ucx = "ucx" in ports
    publishers = {"TCP": WeightPublisher(TRAINER, SECRET, SessionConfig(), transport="tcp")}
    if have_ucx:
        ucx.RUNTIME.acquire()  # the raw UCX route shares the publisher's ucxx context
        publishers["UCX"] = WeightPublisher(TRAINER, SECRET, SessionConfig(), transport="ucx")
    for kind, publisher in publishers.items():
        publisher.add_target("gen", HOST, ports["tcp"], ucx_port=ports.get("ucx") if kind == "UCX" else None)
    async with asyncio.TaskGroup() as tg:
        for publisher in publishers.values():
            tg.create_task(publisher.run())
        routes = [publisher_route(f"WeightPublisher over {kind}", p, versions) for kind, p in publishers.items()]
        routes.append(await raw_tcp_route(ports["raw-tcp"]))
        if have_ucx:
            routes.append(await raw_ucx_route(ports["raw-ucx"]))
        for label, weights in payloads.items():
            for route in routes:
                route.rounds[label] = [await route.run(weights)]  # warm-up, kept apart: its stall is the cold one
            for _ in range(rounds):
                for route in routes:
                    route.rounds[label].append(await route.run(weights))
        for publisher in publishers.values():
            await publisher.close()
        for route in routes:
            if route.close is not None:
                await route.close()
    if have_ucx:
        ucx.RUNTIME.release()
    return routes


# -- report --------------------------------------------------------------------------------------------


def table(routes: list[Route], payloads: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    lines = [
        "| state dict | route | bytes | push ms | push GiB/s | push / raw TCP | stall ms: publish() | stall / total"
        " | total ms | push, every round (ms) | stall: cold; every round (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for label, weights in payloads.items():
        size = nbytes(weights)
        raw_tcp = next(r for r in routes if r.name.startswith("raw TCP"))
        raw = statistics.median(r[1] for r in raw_tcp.rounds[label][1:])
        for route in routes:
            cold, measured = route.rounds[label][0], route.rounds[label][1:]
            stall, push, total = (statistics.median(r[i] for r in measured) for i in range(3))
            pushes = ", ".join(f"{r[1] * 1e3:.1f}" for r in measured)
            stalls = f"{cold[0] * 1e3:.1f}; " + ", ".join(f"{r[0] * 1e3:.1f}" for r in measured) if stall else "-"
            lines.append(
                f"| {label} | {route.name} | {size / MIB:.1f} MiB | {push * 1e3:.1f} | {size / push / GIB:.2f}"
                f" | {push / raw:.2f} | {f'{stall * 1e3:.1f}' if stall else '-'}"
                f" | {f'{stall / total:.2f}' if stall else '-'} | {total * 1e3:.1f} | {pushes} | {stalls} |"
            )
    return lines


def machine() -> str:
    missing = ucx_unavailable()  # importing ucxx sets the UCX_* defaults this run uses
    ucx_note = f"ucxx {pkg_version('ucxx-cu12')}, UCX_TLS={os.environ.get('UCX_TLS', '?')}"
    if missing is not None:
        ucx_note = f"no UCX ({missing})"
    return describe(["torch", "uvloop"], ucx_note)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per route (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report file (default {DEFAULT_OUT})")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    quiet_logs()
    started, host, t0 = datetime.datetime.now().astimezone(), machine(), time.perf_counter()
    payloads = {"(a) tiny model": tiny_model_state_dict(), "(b) 25 x 4 MiB fp32": big_state_dict()}
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=child_main, args=(theirs,), name="weights-receiver", daemon=True)
    proc.start()
    theirs.close()
    try:
        if not ours.poll(60):
            raise RuntimeError(f"the receiver did not start within 60 s (exit code {proc.exitcode})")
        routes = uvloop.run(measure(ours.recv(), payloads, rounds))
    finally:
        ours.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    lines = [
        "# Weight-sync benchmark",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {host}",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root; took {time.perf_counter() - t0:.0f} s)",
        f"- {rounds} measured rounds per route after a warm-up round; medians first, then every round",
        "- push: first byte to the receiver's ack; stall: what publish() took (all the trainer waits for);"
        " total: publish() called to wait_delivered() returning",
        "- stall cold: the warm-up round (fresh bucket buffers); the first measured round copies into fresh buffers"
        " too (two versions are in use before one is recycled), later rounds into reused ones",
        "",
        *table(routes, payloads),
        "",
    ]
    report = "\n".join(lines)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)


if __name__ == "__main__":
    main()
