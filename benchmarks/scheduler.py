"""The scheduler alone as the cluster grows: LLMProxy, the Dispenser and the SampleBuffer, driven
directly (no nodes, no sessions, no simulated engines), per trajectory and per turn.

Run from the repository root (about a minute):

    .venv/bin/python benchmarks/scheduler.py            # writes benchmarks/results/scheduler.md
    .venv/bin/python benchmarks/scheduler.py --quick    # 1x, 10x, 100x only
    .venv/bin/python benchmarks/scheduler.py --routing disaggregated   # scheduler-disaggregated.md

What one growth factor F runs, in one asyncio loop: 2F env-hosts, each with its own LLMProxy
(`routing: finish-time`, or as `--routing` says; `disaggregated` makes two calls a turn) over
every generator node (F engines of each class, 64 per node, as benchmarks/paper/scale.py lays them
out), a Dispenser and SampleBuffer of batch 2F groups of 8 at alpha 1, and 4 batches of groups:
each group granted to an env-host by the dispenser (waiting for room like the trainer's grants),
its 8 trajectories' 4 turns each routed by the env-host's proxy to a generator that answers at
once, the group put in the buffer, its lease completed, and batches taken as they fill. Every
group in flight at once (up to the admission limit), so generators carry load and picks matter.

The run uses the in-process simulation's garbage-collector thresholds: with the defaults, the
cyclic collector's passes over a heap that grows with the cluster land on whichever function
allocates (measured here: LLMProxy._pick 2.1 us per call at 100x, 7.5 us at 1000x with the
default thresholds; 3.0 and 1.9 us with the simulation's).

A second table times one `LLMProxy._pick` alone, for a task with measured calls (routed by predicted
finish time) and for one without (by class), with 10 to 10,000 generators of each class behind one
proxy, each with its own measured service time and reported backlog: what one turn's routing costs at
any cluster size.

CPU time is cProfile's tottime of the scheduler's own files (rollart/rollout/dispenser.py, proxy.py,
routing/, buffer.py) and the harness's process time, both per trajectory and per turn, with the ratio to
1x. The in-process simulation's curve (benchmarks/results/paper/scale.md) runs the same code among
thousands of nodes' objects; this one runs it alone, so the two together tell the scheduler's own
growth from what the whole simulation adds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime
import gc
import logging
import math
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import describe  # noqa: E402 - benchmarks/machine.py
from scheduling import SCHEDULING_FILES  # noqa: E402 - benchmarks/scheduling.py

from rollart.launch.inprocess import GC_THRESHOLD  # noqa: E402
from rollart.protocol import State  # noqa: E402
from rollart.protocol.messages import Generate, Generated, GroupDone, Trajectory  # noqa: E402
from rollart.rollout.buffer import SampleBuffer  # noqa: E402
from rollart.rollout.config import RolloutSpec, Routing, TaskSpec  # noqa: E402
from rollart.rollout.dispenser import Dispenser  # noqa: E402
from rollart.rollout.proxy import LLMProxy  # noqa: E402
from rollart.rollout.routing.base import GeneratorRef, TaskProfiler  # noqa: E402
from rollart.rollout.staleness import StalenessBound  # noqa: E402

REPLICAS_PER_NODE = 64
GROUP, TURNS, BATCHES = 8, 4, 4


class InstantSession:
    """A generator's session that is up and answers every turn at once (after one loop pass)."""

    state = State.UP

    def __init__(self, name: str) -> None:
        self.name = name
        self.down = asyncio.Event()  # never set: the session never drops

    async def request(self, msg: Generate, *, timeout: float) -> Generated:
        await asyncio.sleep(0)
        # A load report as a busy engine gives one, so the finish-time router's backlog is exercised.
        return Generated(
            msg.request_id, [7, 8], [-0.1, -0.1], [0, 0], "length", len(msg.prompt_ids), self.name, 0.001, 8, 2
        )


def trajectory(tid: str, group: str, version: int) -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        task="game",
        seed=1,
        prompt_ids=[1],
        response_ids=[2],
        response_mask=[1],
        logprobs=[-0.5],
        versions=[version],
        reward=1.0,
        env_reward=1.0,
        turns=TURNS,
        finish="done",
        started_at_version=version,
        started_at=0.0,
        finished_at=1.0,
        env_wait_s=0.0,
        gen_wait_s=0.0,
    )


async def run(factor: int, routing: Routing) -> dict[str, int]:
    batch = 2 * factor
    spec = RolloutSpec(
        tasks=[
            TaskSpec(name="game", env="frozen-lake", profile="prefill-heavy"),
            TaskSpec(name="math", env="copy-reverse"),
        ],
        group_size=GROUP,
        redundancy=0,
        batch_groups=batch,
        alpha=1,
    )
    buffer = SampleBuffer(batch_groups=batch, bound=StalenessBound(1))
    dispenser = Dispenser(spec, buffered=lambda: len(buffer))
    nodes = math.ceil(factor / REPLICAS_PER_NODE)
    sessions = [InstantSession(f"gen-{kind}-{i}") for kind in ("compute", "bandwidth") for i in range(nodes)]
    env_hosts = [f"env-{i}" for i in range(2 * factor)]
    proxies = {
        name: LLMProxy(
            [GeneratorRef(s.name, s.name.split("-")[1], s) for s in sessions],  # type: ignore[arg-type]
            TaskProfiler({"game": "prefill-heavy", "math": "decode-heavy"}, ratio=4.0),
            timeout_s=30.0,
            routing=routing,
        )
        for name in env_hosts
    }
    version, groups_total = 0, BATCHES * batch
    counts = {"trajectories": 0, "turns": 0, "stale": 0}

    async def one_group(env_host: str) -> None:
        accepted = False
        while not accepted:  # a group that went stale meanwhile is run again, as env-hosts do
            accepted = await group_once(env_host)

    async def group_once(env_host: str) -> bool:
        task = await dispenser.grant(env_host, version, wait_s=3600.0)
        assert task is not None
        proxy = proxies[env_host]

        async def one_trajectory(i: int) -> Trajectory:
            tid, started = f"{task.group_id}.{i}", version  # as the env-host stamps a trajectory: now
            for turn in range(TURNS):
                await proxy.generate(task.task, Generate(f"{tid}.{turn}", tid, [1] * 8, max_tokens=2))
                counts["turns"] += 1
            proxy.forget(tid)
            counts["trajectories"] += 1
            return trajectory(tid, task.group_id, started)

        done = await asyncio.gather(*(one_trajectory(i) for i in range(GROUP)))
        accepted, why = buffer.put(GroupDone(task.group_id, list(done)), version)
        if not accepted:
            dispenser.reissue(task.group_id, why)
            counts["stale"] += 1
            return False
        dispenser.complete(task.group_id)
        return True

    async def trainer() -> None:
        nonlocal version
        for _ in range(BATCHES):
            await buffer.take()
            version += 1
            buffer.drop_stale(version)
            dispenser.changed()

    groups = [asyncio.ensure_future(one_group(env_hosts[g % len(env_hosts)])) for g in range(groups_total)]
    training = asyncio.ensure_future(trainer())
    await asyncio.wait([training, *groups], return_when=asyncio.FIRST_EXCEPTION)
    if not training.done():  # a group failed: say why instead of waiting forever
        training.cancel()
        failed = next(g for g in groups if g.done() and g.exception() is not None)
        raise RuntimeError("a group of the harness failed") from failed.exception()
    for group in groups:
        group.cancel()
    await asyncio.gather(*groups, return_exceptions=True)
    return counts


def measure(factor: int, routing: Routing) -> dict[str, Any]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # no info lines
    profiler = cProfile.Profile()
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)  # as the in-process simulation runs (its docstring says why)
    began_cpu, began = time.process_time(), time.monotonic()
    profiler.enable()
    try:
        counts = asyncio.run(run(factor, routing))
    finally:
        profiler.disable()
        gc.set_threshold(*thresholds)
    cpu = time.process_time() - began_cpu
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # pstats keeps this dict
    scheduler = sum(row[2] for (path, _, _), row in stats.items() if path.endswith(SCHEDULING_FILES))
    return {
        "factor": factor,
        "generator_nodes": 2 * math.ceil(factor / REPLICAS_PER_NODE),
        **counts,
        "scheduler_us_traj": 1e6 * scheduler / counts["trajectories"],
        "scheduler_us_turn": 1e6 * scheduler / counts["turns"],
        "cpu_us_turn": 1e6 * cpu / counts["turns"],
        "wall_s": time.monotonic() - began,
    }


PICKS = 20_000
POOLS = (10, 100, 1000, 10_000)


def pick_cost(per_class: int) -> dict[str, float]:
    """Microseconds per `_pick` with `per_class` generators of each class behind one proxy: for a task with
    measured calls (finish time) and one without (class routing)."""
    rng = random.Random(per_class)
    refs = [
        GeneratorRef(f"gen-{kind}-{i}", kind, InstantSession(f"gen-{kind}-{i}"), in_flight=rng.randrange(8))  # type: ignore[arg-type]
        for kind in ("compute", "bandwidth")
        for i in range(per_class)
    ]
    proxy = LLMProxy(refs, TaskProfiler({"game": "prefill-heavy"}, ratio=4.0), timeout_s=30.0, routing="finish-time")
    now = time.monotonic()
    for ref in refs:
        reply = Generated("r", [1], [0.0], [0], "stop", 8, ref.name, 0.0, rng.randrange(1, 64), rng.randrange(8))
        proxy._record(ref, "game", rng.uniform(0.5, 2.0), reply, now)
    costs = {}
    for label, task in (("finish_time_us", "game"), ("class_us", "unmeasured")):
        began = time.process_time()
        for i in range(PICKS):
            proxy._pick(f"t{i % 64}", task, "compute", set())
        costs[label] = 1e6 * (time.process_time() - began) / PICKS
    return costs


def pick_table(costs: dict[int, dict[str, float]]) -> str:
    base = costs[POOLS[0]]
    lines = [
        "| generators per class | finish-time pick, us | vs 10 | class pick, us | vs 10 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, c in costs.items():
        lines.append(
            f"| {n:,} | {c['finish_time_us']:.2f} | {c['finish_time_us'] / base['finish_time_us']:.2f} "
            f"| {c['class_us']:.2f} | {c['class_us'] / base['class_us']:.2f} |"
        )
    return "\n".join(lines)


def table(points: list[dict[str, Any]]) -> str:
    base = points[0]
    lines = [
        "| growth | env-hosts (proxies) | generator nodes | trajectories | turns | scheduler CPU us / trajectory "
        "| scheduler CPU us / turn | vs 1x (scheduler / turn) | harness CPU us / turn (profiled) | wall s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p['factor']}x | {2 * p['factor']} | {p['generator_nodes']} | {p['trajectories']} | {p['turns']} "
            f"| {p['scheduler_us_traj']:.1f} | {p['scheduler_us_turn']:.2f} "
            f"| {p['scheduler_us_turn'] / base['scheduler_us_turn']:.2f} | {p['cpu_us_turn']:.1f} | {p['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1x, 10x, 100x only")
    parser.add_argument("--routing", choices=["finish-time", "disaggregated"], default="finish-time")
    parser.add_argument("--out", type=Path, default=None, help="default scheduler.md (scheduler-ROUTING.md)")
    args = parser.parse_args()
    name = "scheduler" + (f"-{args.routing}" if args.routing != "finish-time" else "")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"{name}.md"
    factors = [1, 10, 100] if args.quick else [1, 10, 100, 1000]
    began = time.monotonic()
    measure(1, args.routing)  # warm-up: imports, first-call costs
    points = []
    for factor in factors:
        points.append(measure(factor, args.routing))
        print(f"{factor}x: {points[-1]}", flush=True)
    body = table(points)
    print(body)
    pick_cost(POOLS[0])  # warm-up
    picks = {n: pick_cost(n) for n in POOLS}
    picks_body = pick_table(picks)
    print(picks_body)
    command = "python benchmarks/scheduler.py" + (" --quick" if args.quick else "")
    command += f" --routing {args.routing}" if args.routing != "finish-time" else ""
    args.out.write_text(
        "# The scheduler alone as the cluster grows\n\n"
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: {describe(['msgspec'])}\n"
        f"- command: `{command}` (from the repository root; took {time.monotonic() - began:.0f} s)\n"
        f"- shape: per growth factor F, 2F env-hosts with an LLMProxy each (routing: {args.routing}) over F "
        "engines of each class "
        f"({REPLICAS_PER_NODE} per generator node), batch 2F groups of {GROUP}, alpha 1, {BATCHES} batches, "
        f"{TURNS} turns per trajectory, generators answering at once; gc thresholds {GC_THRESHOLD} as in the "
        "in-process simulation; CPU by cProfile\n\n"
        f"{body}\n\n"
        f"One `LLMProxy._pick` alone ({PICKS:,} picks, process time), generators with measured service times "
        "and reported backlogs:\n\n"
        f"{picks_body}\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
