"""A long training run with periodic faults: does any node's memory, file descriptors or asyncio
task count creep up?

Run from the repository root (30 minutes by default, nothing else running):

    .venv/bin/python benchmarks/soak.py                   # writes benchmarks/results/soak.md, .png, .csv
    .venv/bin/python benchmarks/soak.py --minutes 5 --out /tmp/soak.md

The run is rollart/testkit/harness.py's topology (trainer, two generators behind partition proxies, two
env-hosts, reward gateway; the tiny model) training until stopped, with, in turn every 20-40 s: a
SIGSTOP hang of a random node past the heartbeat deadline, a 10 s partition of the env-hosts from
the generators, and a kill -9 of an env-host; and throughout, flaky envs (20% of calls fail, 2%
hang past their timeout) and reward workers that die mid-request (10%). The trainer, generators and
reward gateway are never killed, so their processes live the whole run: they are the ones whose
numbers must stay flat while their peers die, hang, vanish behind a partition and come back.

Every 5 s the harness samples each node process's RSS (/proc/PID/status VmRSS), open file
descriptors (/proc/PID/fd) and asyncio tasks (`asyncio_tasks` in /status). The table compares each
long-lived process's median over the first and the last fifth of the run (after a warm-up of 2
minutes: model loading, first checkpoints, allocator arenas); the plot shows every sample, and
the .csv beside the table holds them (minute, node, pid, RSS MiB, fds, tasks).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import describe  # noqa: E402 - benchmarks/machine.py

from rollart.testkit.harness import ROLES, ChaosRun  # noqa: E402
from rollart.testkit.outcome import Outcome, Sample, Scenario  # noqa: E402
from rollart.tiny.model import ensure_tiny_model  # noqa: E402

WARM_UP_S = 120.0
FAULTS = ("hang", "partition", "kill-env-host", "env-faults", "reward-crash")


def by_process(samples: list[Sample]) -> dict[tuple[str, int], list[Sample]]:
    series: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for sample in samples:
        series[(sample.node, sample.pid)].append(sample)
    return series


def table(outcome: Outcome, t0: float) -> list[str]:
    """Per long-lived process: first and last fifth (after warm-up) of RSS, fds and tasks."""
    rows = []
    for (node, pid), series in sorted(by_process(outcome.samples).items()):
        steady = [s for s in series if s.t - t0 >= WARM_UP_S]
        if len(steady) < 10:
            continue  # an env-host incarnation too short to say anything
        fifth = max(2, len(steady) // 5)
        first, last = steady[:fifth], steady[-fifth:]
        cells = []
        for key in ("rss_mb", "fds", "tasks"):
            a = statistics.median(getattr(s, key) for s in first)
            b = statistics.median(getattr(s, key) for s in last)
            cells.append(f"{a:.0f} -> {b:.0f} ({b - a:+.0f})")
        minutes = (steady[-1].t - steady[0].t) / 60
        rows.append(f"| {node} | {pid} | {minutes:.1f} | " + " | ".join(cells) + " |")
    return rows


def plot(outcome: Outcome, t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    colors = dict(zip(ROLES, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    labelled: set[str] = set()
    for (node, _), series in by_process(outcome.samples).items():
        minutes = [(s.t - t0) / 60 for s in series]
        label = node if node not in labelled else None
        labelled.add(node)
        for ax, key in zip(axes, ("rss_mb", "fds", "tasks"), strict=True):
            ax.plot(minutes, [getattr(s, key) for s in series], color=colors[node], label=label, lw=1)
    for injection in outcome.injections:
        for ax in axes:
            ax.axvline((injection.at - t0) / 60, color="grey", alpha=0.25, lw=0.8)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("open file descriptors")
    axes[2].set_ylabel("asyncio tasks")
    axes[2].set_xlabel("minutes (grey lines: injected faults)")
    axes[0].legend(loc="upper left", ncols=3, fontsize=8)
    axes[0].set_title("Soak: every node process, sampled every 5 s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.md")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "soak")
    args = parser.parse_args()
    began = time.monotonic()
    machine = describe(["torch", "transformers"])
    model = ensure_tiny_model(args.work / "model", seed=0)
    scenario = Scenario("soak", FAULTS, steps=None, duration_s=args.minutes * 60, gap_s=(20.0, 40.0))
    folder = args.work / f"soak-{int(time.time())}"
    print(f"== soak: {args.minutes:g} minutes, run folder {folder}", flush=True)
    outcome = asyncio.run(ChaosRun(scenario, folder, model).run())
    t0 = min(s.t for s in outcome.samples)
    png = args.out.with_suffix(".png")
    plot(outcome, t0, png)
    with args.out.with_suffix(".csv").open("w") as out:  # every sample, to check the plot by
        out.write("minute,node,pid,rss_mb,fds,tasks\n")
        out.writelines(
            f"{(s.t - t0) / 60:.3f},{s.node},{s.pid},{s.rss_mb:.1f},{s.fds},{s.tasks}\n" for s in outcome.samples
        )
    kinds = defaultdict(int)
    for injection in outcome.injections:
        kinds[injection.kind] += 1
    recovered = sum(1 for i in outcome.injections if i.recovery_s is not None)
    injected = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    continuous = ", ".join(f"{n} {kind}" for kind, n in sorted(outcome.continuous.items()))
    command = "python benchmarks/soak.py" + "".join(f" {a}" for a in sys.argv[1:])
    args.out.write_text(
        "# Soak: a long training run with periodic faults\n\n"
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: {machine}\n"
        f"- command: `{command}` (from the repository root; took {time.monotonic() - began:.0f} s)\n"
        f"- run: {outcome.steps_trained} steps, {outcome.trajectories} trajectories trained; launcher exit "
        f"{outcome.exit_code}\n"
        f"- faults injected: {injected} ({recovered} recovered from); continuous: {continuous}\n"
        f"- invariants: {outcome.explain()}; lost {outcome.lost}, duplicated {outcome.duplicated}, "
        f"seeds given up {outcome.abandoned}\n"
        f"- plot: [{png.name}]({png.name})\n\n"
        f"Median of the first fifth -> the last fifth of each process's samples after the first "
        f"{WARM_UP_S / 60:g} minutes (change):\n\n"
        "| node | pid | minutes | RSS MiB | open fds | asyncio tasks |\n|---|---:|---:|---|---|---|\n"
        + "\n".join(table(outcome, t0))
        + "\n"
    )
    print(args.out.read_text())


if __name__ == "__main__":
    main()
