"""UCX teardown: does a generator's weight receiver end cleanly when drained while the trainer still pushes?

Issue 17 item 7: in a default run (weights over UCX, vLLM generators) where a generator, an env-host
and the reward gateway had been killed with kill -9 and restarted, the *other* generator died of
SIGSEGV during the final drain, in ucxx's progress thread. This reproduces that drain with real
processes on loopback and counts how they end, cycle after cycle.

Run from the repository root (about 8 s a cycle):

    .venv/bin/python benchmarks/ucx_teardown.py                  # 20 cycles: the report's "after" section
    .venv/bin/python benchmarks/ucx_teardown.py --cycles 5 --out /tmp/ucx_teardown.md

The report is benchmarks/results/ucx_teardown.md (`--out`); a run replaces its `--label`'s section
(default "after"). The code before the fix: `git checkout ebe5914 -- rollart/weights` (the commit that
added this script), run with `--label before`, then `git checkout HEAD -- rollart/weights`.

One cycle: a generator process (a `WeightReceiver` listening for UCX, drained as `GeneratorNode`
drains it: its engine stops taking weights, and the receiver closes 0-1 s later, as vLLM's engine
takes seconds to close) and a trainer process (a `WeightPublisher` over UCX pushing a ~2.4 MiB
version every 0.2 s, and on SIGTERM one last version, which it then waits up to 2 s to land, as the
trainer node waits 30 s), both on uvloop and ended as `rollart.node` ends a node. The trainer is
killed with SIGKILL once (mid-push or idle, as it falls) and restarted; after two more versions both
get SIGTERM at once (the launcher's drain). Counted per cycle: how each process ended (a negative
code is the signal that ended it), and whether the generator's UCX listener callback ran on freed
data: in these small processes the freed memory was mostly reused by another dict, so ucxx logged a
KeyError from the callback and the process lived; in the reported vLLM generator it held something
else and the process died of SIGSEGV (docs/weights.md, "Shutdown").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # machine.py, when run from elsewhere
HOST = "127.0.0.1"
SECRET = b"ucx teardown benchmark"
PUBLISH_EVERY_S = 0.2
HUNG = -999
FINAL_PUSH_S = 2.0  # the trainer node waits 30 s for its last version to land


def weights(version: int) -> dict[str, Any]:
    import torch

    return {  # about the tiny default model's size, in 3 buckets of 1 MiB
        "model.embed_tokens.weight": torch.full((512, 1024), float(version)),
        "model.norm.weight": torch.full((64,), float(version)),
        "lm_head.weight": torch.full((64, 1024), -float(version)),
    }


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# -- the processes -------------------------------------------------------------------------------


async def _receiver(engine_close_s: float) -> None:
    """A generator's weight path: `WeightReceiver` serving UCX; drained as `GeneratorNode` drains."""
    from rollart.protocol import Identity, SessionConfig
    from rollart.weights.receiver import WeightReceiver

    engine_up = True

    async def apply(version: int, tensors: dict[str, Any]) -> None:
        if not engine_up:
            raise RuntimeError("the engine is closed")  # as a generator's engine refuses weights once closed
        _say(event="applied", version=version)

    receiver = WeightReceiver(apply)
    drain = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, drain.set)
    async with asyncio.TaskGroup() as tg:  # as GeneratorNode.work: serve, listen, close when drained
        tg.create_task(receiver.serve())
        port = await receiver.listen_ucx(local=Identity("gen", "generator"), secret=SECRET, cfg=SessionConfig())
        _say(event="listening", port=port)
        try:
            await drain.wait()
            engine_up = False  # the engine closes first (vLLM's took ~4 s in the reported run) ...
            await asyncio.sleep(engine_close_s)
        finally:
            await receiver.close()  # ... then the receiver
    _say(event="closed")


async def _publisher(ports: dict[str, int]) -> None:
    """The trainer's weight path: `WeightPublisher` over UCX, a new version every PUBLISH_EVERY_S."""
    from rollart.protocol import Identity, SessionConfig
    from rollart.weights.config import WeightsSpec
    from rollart.weights.publisher import WeightPublisher

    settings = WeightsSpec(bucket_mb=1, transport="ucx")
    publisher = WeightPublisher(Identity("trainer", "trainer"), SECRET, SessionConfig(), settings)
    for name, port in ports.items():
        publisher.add_target(name, HOST, 0, ucx_port=port)
    drain = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, drain.set)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        version = int(time.time() * 10)  # a restarted publisher goes on with newer versions
        while True:
            version += 1
            await asyncio.to_thread(publisher.publish, version, weights(version))
            if drain.is_set():  # the run's last version, published as the nodes drain (as in the reported run)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain.wait(), PUBLISH_EVERY_S)
        with contextlib.suppress(TimeoutError):  # as the trainer's close: the last version gets a while to land
            await publisher.wait_delivered(version, timeout=FINAL_PUSH_S)
        await publisher.close()


def child_main(role: str, args: list[str]) -> int:
    import structlog
    import uvloop

    from rollart.logs import configure_logging
    from rollart.node import _leave_stuck_threads

    configure_logging(node=role, role=role, level="info")
    if role == "receiver":
        uvloop.run(_receiver(float(args[0])))
    else:
        uvloop.run(_publisher({name: int(port) for name, port in (arg.split("=") for arg in args)}))
    _leave_stuck_threads(structlog.get_logger("rollart.node"), 0)  # how rollart.node ends a node
    return 0


# -- the driver ----------------------------------------------------------------------------------


class Child:
    def __init__(self, role: str, name: str, log_dir: Path, args: list[str]) -> None:
        self.role, self.name, self.log_path = role, name, log_dir / f"{name}.log"
        self.args = args
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.applied: list[int] = []

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "child", self.role, *self.args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self.log, env=env, cwd=ROOT,
        )  # fmt: skip
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.log.write(line)
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            if fields.get("event") == "applied":
                self.applied.append(fields["version"])
            self.lines.put_nowait(fields)

    async def wait_for(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while (fields := await self.lines.get()).get("event") != event:
                pass
        return fields

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def ended(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            code = HUNG
        await self.reader
        self.log.close()
        return code


async def until(condition: Any, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - another process's state, read from its output
            await asyncio.sleep(0.05)


async def cycle(log_dir: Path, rng: random.Random) -> dict[str, int]:
    """One cycle; returns how the processes that were not killed on purpose ended."""
    engine_close_s = rng.uniform(0.0, 1.0)
    generator = Child("receiver", "generator", log_dir, [f"{engine_close_s:.3f}"])
    await generator.start()
    target = f"gen={(await generator.wait_for('listening'))['port']}"
    trainer = Child("publisher", "trainer", log_dir, [target])
    await trainer.start()
    await until(lambda: len(generator.applied) >= 2)
    # The generator's peer killed, mid-push or idle as it falls, and restarted.
    await asyncio.sleep(rng.uniform(0, PUBLISH_EVERY_S))
    trainer.signal(signal.SIGKILL)
    await trainer.ended()
    trainer = Child("publisher", "trainer.2", log_dir, [target])
    await trainer.start()
    seen = len(generator.applied)
    await until(lambda: len(generator.applied) >= seen + 2)
    # The launcher's drain: SIGTERM to both at once.
    await asyncio.sleep(rng.uniform(0, PUBLISH_EVERY_S))
    for child in (generator, trainer):
        child.signal(signal.SIGTERM)
    codes = await asyncio.gather(generator.ended(), trainer.ended())
    return {"generator": codes[0], "trainer": codes[1]}


FREED_CALLBACK = "when calling listener callback"
"""What ucxx logs when the listener's callback raises: seen here when the callback ran on callback data
already freed (a KeyError on a dict that reused the memory); where the memory held something else the
process died of SIGSEGV instead (the reported crash)."""


@dataclass
class Cycle:
    codes: dict[str, int]
    """How each process that was not killed on purpose ended (negative: the signal)."""
    freed_callback: bool
    """The generator's listener callback ran after its data was freed (ucxx logged the error)."""

    @property
    def clean(self) -> bool:
        return not self.freed_callback and all(code == 0 for code in self.codes.values())

    def describe(self) -> str:
        bad = [f"{name} {describe_code(code)}" for name, code in self.codes.items() if code != 0]
        if self.freed_callback:
            bad.append("listener callback ran on freed data")
        return ", ".join(bad) or "all exited 0"


def describe_code(code: int) -> str:
    if code == HUNG:
        return "hung (killed after 60 s)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


async def main_async(args: argparse.Namespace) -> list[Cycle]:
    rng = random.Random(args.seed)
    results = []
    for index in range(args.cycles):
        started = time.monotonic()
        log_dir = args.logs / f"cycle-{index:03d}"
        await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
        codes = await cycle(log_dir, rng)
        log = await asyncio.to_thread((log_dir / "generator.log").read_text, errors="replace")
        result = Cycle(codes, FREED_CALLBACK in log)
        results.append(result)
        took = time.monotonic() - started
        print(f"cycle {index + 1}/{args.cycles} ({took:.1f} s): {result.describe()}", flush=True)
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child_main(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/ucx_teardown"), help="each process's log, per cycle")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ucx_teardown.md")
    parser.add_argument("--label", default="after", help="the section of the report this run fills (before, after)")
    args = parser.parse_args()
    started = time.monotonic()
    results = asyncio.run(main_async(args))
    seconds = time.monotonic() - started
    print(summary(results) + f" ({seconds:.0f} s)")
    write_report(args, results, seconds)


def summary(results: list[Cycle]) -> str:
    died = Counter(describe_code(c.codes["generator"]) for c in results if c.codes["generator"] != 0)
    freed = sum(c.freed_callback for c in results)
    others = sum(any(code != 0 for name, code in c.codes.items() if name != "generator") for c in results)
    return (
        f"{sum(not c.clean for c in results)} of {len(results)} cycles unclean: generator died in "
        f"{sum(died.values())} ({', '.join(f'{n} {what}' for what, n in died.items()) or 'none'}), its listener "
        f"callback ran on freed data in {freed}, the trainer ended non-zero in {others}"
    )


def write_report(args: argparse.Namespace, results: list[Cycle], seconds: float) -> None:
    """Replace this run's section (`--label`) of the report, keeping the others."""
    from machine import describe

    sections: dict[str, str] = {}
    if args.out.exists():
        for block in args.out.read_text().split("\n## ")[1:]:
            title, _, body = block.partition("\n")
            sections[title.strip()] = body.strip()
    command = shlex.join([sys.executable, *sys.argv]).replace(str(ROOT) + "/", "")
    lines = [
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; commit {_commit()}",
        f"- machine: {describe(['ucxx-cu12', 'uvloop'])}",
        f"- command: `{command}` ({seconds:.0f} s)",
        f"- **{summary(results)}**",
        "",
        "| cycles | how they ended |",
        "|---|---|",
        *(f"| {span} | {what} |" for span, what in _runs(results)),
    ]
    sections[args.label] = "\n".join(lines)
    head = (__doc__ or "").split("\n\n", 1)[1].split("\nRun from", 1)[0].strip()
    text = ["# UCX teardown while the trainer still pushes (benchmarks/ucx_teardown.py)", "", head, ""]
    for title in sorted(sections, key=lambda t: (t != "before", t)):
        text += [f"## {title}", "", sections[title], ""]
    args.out.write_text("\n".join(text))


def _runs(results: list[Cycle]) -> list[tuple[str, str]]:
    """Consecutive cycles that ended alike, as ("first-last", how)."""
    runs: list[tuple[int, int, str]] = []
    for index, result in enumerate(results, start=1):
        if runs and runs[-1][2] == result.describe():
            runs[-1] = (runs[-1][0], index, runs[-1][2])
        else:
            runs.append((index, index, result.describe()))
    return [(f"{first}" if first == last else f"{first}-{last}", how) for first, last, how in runs]


def _commit() -> str:
    """HEAD, and when rollart/ differs from it, the recent commit whose rollart/ it matches (the code measured)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    if not git("status", "--porcelain", "rollart").stdout.strip():
        return head
    for commit in git("rev-list", "--max-count=50", "HEAD").stdout.split():
        if git("diff", "--quiet", commit, "--", "rollart").returncode == 0:
            return f"{head}, with rollart/ checked out as of {commit[:7]}"
    return f"{head} with uncommitted changes under rollart/"


if __name__ == "__main__":
    main()
