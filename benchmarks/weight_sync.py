"""Weight-sync benchmark: pushes next to plain TCP, star vs relay vs group broadcast to 1, 2 and 4 generators.

Run from the repository root (a full run takes 10-20 minutes on 2 cores):

    .venv/bin/python benchmarks/weight_sync.py            # writes benchmarks/results/weight_sync.md
    .venv/bin/python benchmarks/weight_sync.py --quick    # 100 MiB only, 2 rounds: a smoke run
    .venv/bin/python benchmarks/weight_sync.py --out /tmp/weight_sync.md
    .venv/bin/python benchmarks/weight_sync.py --before /tmp/before   # and a checkout of another commit

Then the two measurements of the trainer's and the generator's side of a push, each in a process of its own:
the trainer's stall per push over its step (`benchmarks/export_stall.py`: fsdp2 with 2 ranks and the torch
backend, the BPE test model) and the longest stop of decoding during a push over the swap alone
(`benchmarks/decode_pause.py`, with `.venv-vllm`'s interpreter when it is there: vLLM and the transformers
engine). `--before PATH` runs both again with PYTHONPATH at PATH (a `git worktree` of another commit), so the
rows of the two commits come from one run.

Two state dicts of fp32 tensors of 4 MiB: 100 MiB and 1 GiB, sent as they are (no wire dtype, so
the bytes on the wire are the state's). Four receiver processes (spawn; uvloop), each a
`WeightReceiver` behind a `SessionServer` (TCP) and a UCX listener, each able to relay. Per
configuration (transport TCP or UCX; 1, 2 or 4 generators; star or relay; or transport nccl, which is a gloo
group here, broadcasting each bucket to every generator at once) one `WeightPublisher`
pushes a warm-up version and then N measured ones; after each measured push, raw TCP moves the
same bytes (one blocking `sendall` to a thread doing `recv_into` one reused buffer in receiver
0), so every ratio compares rounds taken next to each other. UCX is also compared with one raw
ucxx send of the same bytes. The receivers' `apply` does nothing: a push is transfer, checksum
checks and unpacking.

Per round: `push` = the trainer's first byte to the last generator's acknowledgement (its
`last_push_s`: for a relayed generator, from the first byte the trainer sent); `rate` = state
bytes / push for one generator; `egress` = bytes the trainer sent / state bytes; `stall` = what
`publish()` took (the trainer's wait); `packed` = when the background packer had copied the last
bucket (the trainer may run its next forward and backward meanwhile, not its optimizer step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import logging
import multiprocessing
import os
import shlex
import socket
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import version as pkg_version
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import structlog
import torch
import uvloop
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script

from rollart.protocol import CONTROL, Identity, Session, SessionConfig, SessionServer
from rollart.weights import ucx
from rollart.weights.config import Fanout, WeightsSpec
from rollart.weights.publisher import WeightPublisher
from rollart.weights.receiver import WeightReceiver
from rollart.weights.ucx import ucx_unavailable

HOST = "127.0.0.1"
SECRET = b"weight sync benchmark"
TRAINER = Identity("bench-trainer", "trainer")
GENERATORS = 4
_U64 = struct.Struct(">Q")
MIB = 1024**2
GIB = 1024**3
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "weight_sync.md"
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def state_dict(mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(mib // 4)}


# -- the receiver process ------------------------------------------------------------------------------


class _NoMessages:
    async def on_event(self, session: Session, msg: Any) -> None: ...

    async def on_request(self, session: Session, msg: Any) -> Any:
        return msg


def raw_tcp_server(listener: socket.socket) -> None:
    """Each connection in turn: rounds of u64 N then N bytes into one reused buffer, each answered with one byte."""
    while True:
        conn, _ = listener.accept()
        raw_tcp_rounds(conn)


def raw_tcp_rounds(conn: socket.socket) -> None:
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


async def serve(pipe: Pipe, index: int) -> None:
    async def apply(version: int, weights: dict[str, torch.Tensor]) -> None:
        pass

    cfg = SessionConfig()
    me = Identity(f"gen-{index}", "generator")
    receiver = WeightReceiver(apply)
    receiver.relay_as(me, SECRET, cfg)
    server = SessionServer(
        local=me, secret=SECRET, channel=CONTROL, handler=_NoMessages(), cfg=cfg, on_bulk=receiver.on_bulk
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
            ports["ucx"] = await receiver.listen_ucx(local=me, secret=SECRET, cfg=cfg)
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


def child_main(pipe: Pipe, index: int) -> None:
    quiet_logs()
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(pipe, index))


# -- measuring --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    transport: str  # "TCP", "UCX" or "GROUP" (transport nccl: a gloo group here)
    generators: int
    fanout: Fanout
    owned: bool = True
    """publish(owned=True): an export made for the push (a cast, a gather), sent over TCP from its own
    memory; False: the trainer's live weights, copied into bucket buffers first."""

    @property
    def label(self) -> str:
        if self.transport == "GROUP":
            return f"WeightPublisher, transport nccl (a gloo group here), {self.generators} gen, broadcast"
        fanout = "" if self.generators == 1 else f", {self.fanout}"
        live = "" if self.owned else ", live weights (copied)"
        return f"WeightPublisher over {self.transport}, {self.generators} gen{fanout}{live}"


@dataclass
class Row:
    config: Config | str
    push: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    """Raw TCP seconds for the same bytes, taken right after each push."""
    egress: list[float] = field(default_factory=list)
    stall: list[float] = field(default_factory=list)
    packed: list[float] = field(default_factory=list)


class RawTcp:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payloads: dict[int, bytearray] = {}

    def push(self, n: int) -> float:
        payload = self.payloads.setdefault(n, bytearray(os.urandom(16)) * (n // 16) + bytearray(n % 16))
        t0 = time.perf_counter()
        self.sock.sendall(_U64.pack(n))
        self.sock.sendall(payload)
        self.sock.recv(1, socket.MSG_WAITALL)
        return time.perf_counter() - t0


async def raw_ucx(port: int, n: int, rounds: int) -> list[float]:
    ep = await ucx.import_ucxx().create_endpoint(HOST, port)
    payload, ack, seconds = bytearray(os.urandom(16)) * (n // 16), bytearray(1), []
    try:
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            await ep.send(bytearray(_U64.pack(n)))
            await ep.send(payload)
            await ep.recv(ack)
            seconds.append(time.perf_counter() - t0)
    finally:
        await ep.close()
    return seconds[1:]


class Versions:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:  # the receivers outlive each publisher: every push must be newer than the last
        self.n += 1
        return self.n


async def measure_config(
    config: Config, ports: list[dict[str, int]], weights: dict[str, torch.Tensor], rounds: int, versions: Versions
) -> Row:
    transport = {"TCP": "tcp", "UCX": "ucx", "GROUP": "nccl"}[config.transport]
    publisher = WeightPublisher(
        TRAINER, SECRET, SessionConfig(), WeightsSpec(transport=transport, fanout=config.fanout)
    )
    for i, port in enumerate(ports[: config.generators]):
        publisher.add_target(f"gen-{i}", HOST, port["tcp"], ucx_port=port.get("ucx") if transport == "ucx" else None)
    raw = RawTcp(ports[0]["raw-tcp"])
    size = nbytes(weights)
    row = Row(config)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        for round_ in range(rounds + 1):  # round 0 warms up: connections, fresh buffers
            version, egress = versions.next(), publisher.egress_bytes
            stall = publisher.publish(version, weights, owned=config.owned)
            await publisher.wait_delivered(version, timeout=600)
            if round_ == 0:
                continue
            stats = publisher.stats()
            row.push.append(max(s.last_push_s for s in stats.values()))
            row.egress.append((publisher.egress_bytes - egress) / size)
            row.stall.append(stall)
            row.packed.append(max(snap.pack_s for snap in publisher._store.latest_all()))
            row.raw.append(await asyncio.to_thread(raw.push, size))
        await publisher.close()
    raw.sock.close()
    del publisher, raw
    gc.collect()  # the next configuration's buffers must not sit next to this one's (1 GiB each)
    return row


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def configs(have_ucx: bool) -> list[Config]:
    out = []
    for transport in ["TCP", "UCX"] if have_ucx else ["TCP"]:
        out.append(Config(transport, 1, "star"))
        if transport == "TCP":
            out.append(Config(transport, 1, "star", owned=False))
        for generators in (2, 4):
            out += [Config(transport, generators, "star"), Config(transport, generators, "relay")]
    out += [Config("GROUP", generators, "star") for generators in (1, 2, 4)]
    return out


async def measure(ports: list[dict[str, int]], sizes: list[int], rounds: dict[int, int]) -> dict[int, list[Row]]:
    versions = Versions()
    have_ucx = "ucx" in ports[0]
    results: dict[int, list[Row]] = {}
    if have_ucx:
        ucx.RUNTIME.acquire()  # the raw UCX rounds share the publishers' ucxx context
    try:
        for mib in sizes:
            weights = state_dict(mib)
            rows = []
            for config in configs(have_ucx):
                rows.append(await measure_config(config, ports, weights, rounds[mib], versions))
                print(f"{mib} MiB, {config.label}: push {statistics.median(rows[-1].push) * 1e3:.0f} ms", flush=True)
            if have_ucx:
                row = Row("raw UCX (one ucxx send into one reused buffer)")
                row.push = await raw_ucx(ports[0]["raw-ucx"], nbytes(weights), rounds[mib])
                rows.append(row)
            results[mib] = rows
            del weights
    finally:
        if have_ucx:
            ucx.RUNTIME.release()
    return results


# -- report --------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: dict[int, list[Row]]) -> tuple[list[str], dict[str, float]]:
    lines = [
        "| state | route | push ms (until the last generator holds it) | push GiB/s (1 gen) | raw TCP GiB/s"
        " (same rounds) | push rate / raw TCP rate | trainer egress / state | stall ms: publish() | stall / push"
        " | packed ms (background) | push, every round (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    summary: dict[str, float] = {}
    for mib, rows in results.items():
        size = mib * MIB
        for row in rows:
            push = median(row.push)
            pushes = ", ".join(f"{p * 1e3:.0f}" for p in row.push)
            if isinstance(row.config, str):
                lines.append(
                    f"| {mib} MiB | {row.config} | {push * 1e3:.1f} | {size / push / GIB:.2f} | - | - | - | - | - | - |"
                    f" {pushes} |"
                )
                continue
            config, raw = row.config, median(row.raw)
            one = config.generators == 1
            ratio = raw / push
            egress, stall, packed = median(row.egress), median(row.stall), median(row.packed)
            lines.append(
                f"| {mib} MiB | {config.label} | {push * 1e3:.1f} | {f'{size / push / GIB:.2f}' if one else '-'}"
                f" | {size / raw / GIB:.2f} | {f'{ratio:.2f}' if one else '-'} | {egress:.2f}"
                f" | {stall * 1e3:.2f} | {stall / push:.4f} | {packed * 1e3:.0f} | {pushes} |"
            )
            if config.transport == "TCP" and one and config.owned:
                summary[f"push_over_raw_{mib}"] = ratio
            if config.transport == "TCP" and config.generators == 4 and config.fanout == "relay":
                summary[f"relay_egress_4gen_{mib}"] = egress
    return lines, summary


def machine() -> str:
    missing = ucx_unavailable()  # importing ucxx sets the UCX_* defaults this run uses
    ucx_note = f"ucxx {pkg_version('ucxx-cu12')}, UCX_TLS={os.environ.get('UCX_TLS', '?')}"
    if missing is not None:
        ucx_note = f"no UCX ({missing})"
    return describe(["torch", "uvloop"], ucx_note)


def start_receivers(count: int) -> tuple[list[Any], list[Pipe], list[dict[str, int]]]:
    ctx = multiprocessing.get_context("spawn")
    procs, pipes, ports = [], [], []
    for i in range(count):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=child_main, args=(theirs, i), name=f"weights-receiver-{i}", daemon=True)
        proc.start()
        theirs.close()
        procs.append(proc)
        pipes.append(ours)
    for proc, pipe in zip(procs, pipes, strict=True):
        if not pipe.poll(60):
            raise RuntimeError(f"a receiver did not start within 60 s (exit code {proc.exitcode})")
        ports.append(pipe.recv())
    return procs, pipes, ports


def side_measurement(
    script: str, python: str | Path, quick: bool, before: Path | None, extra: tuple[str, ...] = ()
) -> list[tuple[str, dict[str, Any]]]:
    """The rows `benchmarks/SCRIPT.py --json` writes, run with `python` at this checkout (and at `before`),
    each labelled with its checkout."""
    import json
    import subprocess
    import tempfile

    rows: list[tuple[str, dict[str, Any]]] = []
    trees = [("this commit", ROOT)] + ([(f"before ({before})", before.resolve())] if before is not None else [])
    for label, tree in trees:
        if script == "decode_pause" and tree != ROOT and not extra:
            # Before `hf weights swapped` was logged the transformers engine's stop cannot be read: vLLM alone.
            extra = ("--engines", "vllm")
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "rows.json"
            short = ["--steps" if script == "export_stall" else "--rounds", "2"] if quick else []
            command = [str(python), str(ROOT / "benchmarks" / f"{script}.py"), "--json", str(out), *short, *extra]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            print(f"{script} at {label}: {shlex.join(command)}", file=sys.stderr, flush=True)
            subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            rows += [(label, row) for row in json.loads(out.read_text())]
    return rows


def stall_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| code | trainer | export API | step s | export s (until out) | stall per push s | stall / step "
        "| stall per push, every step (ms) |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['backend']} | {r['api']} | {r['step_s']:.2f} | {r['export_s']:.3f} | {r['stall_s']:.3f} "
            f"| {r['stall_frac']:.3f} | {', '.join(str(s) for s in r['stalls_ms'])} |"
        )
    return lines


def pause_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| code | engine | push ms | longest token gap, no push ms | longest token gap during a push ms "
        "| longest stop of decoding for a push, in the engine ms | swap alone ms | stop / swap alone "
        "| stop per round ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in rows:
        gap = "-" if r["gap_ms"] is None else f"{r['gap_ms']:.1f}"
        lines.append(
            f"| {label} | {r['engine']} | {r['push_ms']:.0f} | {r['quiet_ms']:.1f} | {gap} | {r['blocked_ms']:.1f} "
            f"| {r['swap_ms']:.1f} | {r['pause_over_swap']:.2f} | {', '.join(str(b) for b in r['blocked_rounds_ms'])} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 MiB only, 2 rounds: a smoke run")
    parser.add_argument(
        "--rounds", type=int, default=5, help="measured rounds per configuration (default 5; 3 at 1 GiB)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report file (default {DEFAULT_OUT})")
    parser.add_argument(
        "--before", type=Path, default=None, help="also measure the stall and the decoding pause at this checkout"
    )
    args = parser.parse_args()
    sizes = [100] if args.quick else [100, 1024]
    rounds = {100: 2, 1024: 2} if args.quick else {100: args.rounds, 1024: max(2, args.rounds - 2)}
    quiet_logs()
    started, host, t0 = datetime.datetime.now().astimezone(), machine(), time.perf_counter()
    procs, pipes, ports = start_receivers(GENERATORS)
    try:
        results = uvloop.run(measure(ports, sizes, rounds))
    finally:
        for pipe in pipes:
            pipe.close()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    rows, summary = table(results)
    stall = side_measurement("export_stall", sys.executable, args.quick, args.before)
    if VLLM_PYTHON.exists():
        pause = side_measurement("decode_pause", VLLM_PYTHON, args.quick, args.before)
    else:  # no vLLM here: the transformers engine alone
        pause = side_measurement("decode_pause", sys.executable, args.quick, args.before, ("--engines", "hf"))
    lines = [
        "# Weight-sync benchmark",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {host}",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root; took {time.perf_counter() - t0:.0f} s)",
        f"- rounds per configuration after a warm-up push: {', '.join(f'{r} at {m} MiB' for m, r in rounds.items())};"
        " medians first, then every round",
        "- fp32 tensors of 4 MiB, pushed as they are (bytes on the wire = state bytes); 4 receiver processes on"
        " this machine, every one relay-capable; relay = one chain trainer -> gen-0 -> gen-1 -> ...; transport nccl"
        " = one gloo group of the trainer and the generators (no CUDA here), each bucket broadcast to all at once,"
        " the manifests and acks over TCP",
        "- `publish(owned=True)` (every row but the one marked live): the tensors are an export made for the push"
        " (as a bf16 cast or an FSDP2 gather is), so over TCP they go from their own memory, checksummed, no copy;"
        " UCX needs one buffer per bucket, so its rows pack (copy) them; the live row copies too (the"
        " trainer's own parameters, which its optimizer changes next)",
        "- push: the trainer's first byte to the last generator's ack; rate and ratio for one generator;"
        " raw TCP: the same bytes by one blocking sendall into one reused buffer, right after each push",
        "- stall: what publish() took (all the trainer waits for, if it does not step its optimizer before"
        " the packer is done); packed: when the packer thread had copied and checksummed the last bucket",
        "",
        *rows,
        "",
        "## The trainer's stall per push (`benchmarks/export_stall.py`)",
        "",
        "How long a push holds the trainer as its learner counts it (the export call, the next step's wait behind"
        " the export, the next optimizer step's wait for the packer), over the step's own time; the BPE test model"
        " in fp32, exported in bf16; medians over the measured steps.",
        "",
        *stall_table(stall),
        "",
        "## Decoding during a push (`benchmarks/decode_pause.py`)",
        "",
        "The longest stop of decoding a push caused, timed in the engine, against the swap alone (the version's"
        " copy into the engine's weights); the callers' token gaps beside it. The BPE test model in fp32, 4"
        " clients decoding; its module docstring says what each column counts.",
        "",
        *pause_table(pause),
        "",
    ]
    z = next(
        (r["stall_frac"] for label, r in stall if label == "this commit" and r["backend"].startswith("fsdp2")), None
    )
    w = next((r["pause_over_swap"] for label, r in pause if label == "this commit" and r["engine"] == "vllm"), None)
    if "push_over_raw_1024" in summary and "relay_egress_4gen_1024" in summary and z is not None and w is not None:
        lines.append(
            f"summary: push_over_raw_1gib={summary['push_over_raw_1024']:.2f}"
            f" relay_egress_4gen={summary['relay_egress_4gen_1024']:.2f}"
            f" export_stall_frac={z:.3f} decode_pause_over_copy={w:.2f}"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)


if __name__ == "__main__":
    main()
