"""Env calls in a thread of the env-host (`EnvRunner`) against env worker processes (`WorkerEnvRunner`).

Run from the repository root (about a minute):

    .venv/bin/python benchmarks/envs.py            # writes benchmarks/results/envs.md
    .venv/bin/python benchmarks/envs.py --quick    # fewer episodes, for a smoke run

The env is the built-in `frozen-lake`, whose calls take microseconds, so what is measured is the
runner: each episode opens an env (built in a thread, or in a worker by name), resets it, takes
`STEPS` steps (a reply without an action: a format penalty, the lake unchanged, so every episode
has the same calls) and closes it, as a trajectory does. One episode at a time gives the latency
a trajectory sees per call; 64 at once (an env-host's 8 groups of 8) gives what the runner
sustains when the env-host is busy. Rates are medians of `ROUNDS` rounds after a warm-up round;
the worker pool is started before the rounds (its cold start is its own row).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import describe  # noqa: E402 - benchmarks/machine.py

from rollart.envexec import EnvRunner, EnvWorkerPool  # noqa: E402
from rollart.envs import EnvHandle, make_env  # noqa: E402

ENV, STEPS, ROUNDS, TIMEOUT_S = "frozen-lake", 6, 5, 30.0
Open = Callable[[], Awaitable[EnvHandle]]


async def episode(open_env: Open) -> int:
    """One trajectory's env calls; how many were made (open and close counted as one each)."""
    env = await open_env()
    await env.reset(seed=1)
    for _ in range(STEPS):
        await env.step("I wait.")
    await env.close()
    return STEPS + 3


def worker_cpu_s(pool: EnvWorkerPool | None) -> float:
    """CPU seconds the pool's workers have used, as their latest replies said."""
    return sum(w["cpu_s"] for w in pool.stats()["workers"]) if pool is not None else 0.0


async def rate(open_env: Open, episodes: int, at_once: int, pool: EnvWorkerPool | None) -> tuple[float, float]:
    """Env calls per second over `episodes` episodes, `at_once` running together, and the CPU
    microseconds per call of the env-host and its workers together."""
    gate = asyncio.Semaphore(at_once)

    async def one() -> int:
        async with gate:
            return await episode(open_env)

    began, cpu = time.perf_counter(), time.process_time() + worker_cpu_s(pool)
    calls = sum(await asyncio.gather(*(one() for _ in range(episodes))))
    wall, cpu = time.perf_counter() - began, time.process_time() + worker_cpu_s(pool) - cpu
    return calls / wall, 1e6 * cpu / calls


def bare_rate(episodes: int) -> tuple[float, float]:
    """The env alone, called directly: what any runner adds to."""
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(episodes):
        env = make_env(ENV)
        env.reset(seed=1)
        for _ in range(STEPS):
            env.step("I wait.")
        env.close()
    calls = episodes * (STEPS + 3)
    return calls / (time.perf_counter() - began), 1e6 * (time.process_time() - cpu) / calls


Row = tuple[str, int, list[tuple[float, float]]]
"""(runner, episodes at once, per round: calls/s and CPU us per call)."""


async def measure(quick: bool) -> tuple[list[Row], float, int]:
    episodes = {1: 100 if quick else 400, 64: 320 if quick else 1280}

    async def in_thread() -> EnvHandle:
        env = await asyncio.to_thread(make_env, ENV)  # as the env-host makes a thread-placed env
        return EnvRunner(env, name=ENV, timeout_s=TIMEOUT_S)

    rows: list[Row] = [("the env alone, called directly", 1, [bare_rate(episodes[1]) for _ in range(ROUNDS + 1)][1:])]
    pools = {}
    for processes in (1, 4):
        began = time.perf_counter()
        pool = EnvWorkerPool(processes=processes)
        await pool.start()
        pools[processes] = (pool, time.perf_counter() - began)
    try:
        runners: list[tuple[str, Open, EnvWorkerPool | None]] = [("thread (EnvRunner)", in_thread, None)]
        for processes, (pool, _) in pools.items():

            async def in_worker(pool: EnvWorkerPool = pool) -> EnvHandle:
                return await pool.open(ENV, timeout_s=TIMEOUT_S)

            label = f"process (WorkerEnvRunner), {processes} worker{'s' * (processes > 1)}"
            runners.append((label, in_worker, pool))
        for at_once, n in episodes.items():
            for label, open_env, pool in runners:
                await rate(open_env, n // 4, at_once, pool)  # warm-up
                rounds = [await rate(open_env, n, at_once, pool) for _ in range(ROUNDS)]
                rows.append((label, at_once, rounds))
                print(f"{label}, {at_once} at once: {median(rounds, 0):,.0f} calls/s", flush=True)
    finally:
        for pool, _ in pools.values():
            await pool.close()
    return rows, pools[4][1], 4


def median(rounds: list[tuple[float, float]], i: int) -> float:
    return statistics.median(r[i] for r in rounds)


def table(rows: list[Row]) -> str:
    thread = {at_once: rounds for label, at_once, rounds in rows if label.startswith("thread")}
    lines = [
        "| runner | episodes at once | env calls/s | us per call (wall) | wall vs thread "
        "| CPU us per call (env-host + workers) | CPU vs thread | rounds (calls/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, at_once, rounds in rows:
        rate, cpu = median(rounds, 0), median(rounds, 1)
        base = thread.get(at_once)
        wall_ratio = f"{median(base, 0) / rate:.2f}" if base else ""
        cpu_ratio = f"{cpu / median(base, 1):.2f}" if base else ""
        shown = ", ".join(f"{r:,.0f}" for r, _ in rounds)
        cells = [label, str(at_once), f"{rate:,.0f}", f"{1e6 / rate:.1f}", wall_ratio, f"{cpu:.1f}", cpu_ratio, shown]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer episodes per round")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "envs.md")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings only
    began = time.monotonic()
    rows, cold_s, processes = asyncio.run(measure(args.quick))
    body = table(rows)
    print(body)
    command = "python benchmarks/envs.py" + (" --quick" if args.quick else "")
    args.out.write_text(
        "# Env calls: a thread of the env-host against env worker processes\n\n"
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: {describe(['msgspec'])}\n"
        f"- command: `{command}` (from the repository root; took {time.monotonic() - began:.0f} s)\n"
        f"- shape: `{ENV}` episodes of open + reset + {STEPS} steps + close ({STEPS + 3} calls), one at a time "
        f"and 64 at once; median of {ROUNDS} rounds after a warm-up; us per call = 1 / rate (at 64 at once, "
        "the env-host's time per call, not a call's latency); CPU: the env-host's process time plus the CPU "
        "seconds the workers report, which a loaded machine moves less than wall time\n"
        f"- cold start of a pool of {processes} workers (spawn to all ready): {cold_s:.2f} s\n\n"
        f"{body}\n\n"
        "One episode at a time, the ratio is what a trajectory pays per env call for a worker process\n"
        "(a socket round trip and a thread hand-off in the worker, against a thread hand-off); 64 at\n"
        "once, what the env-host pays, where several workers also run env code beside the env-host's\n"
        "own process. `run.rollout.env_workers.isolation: auto` keeps RollArt's built-ins in threads for\n"
        'the first and runs user envs in workers (docs/envs.md, "Env worker processes").\n'
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
