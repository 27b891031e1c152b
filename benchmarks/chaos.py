"""Faults injected into real training runs: what was injected, what the run survived, what it lost.

Run from the repository root (about 15 minutes; one run per row, one after another):

    .venv/bin/python benchmarks/chaos.py                  # writes benchmarks/results/chaos.md
    .venv/bin/python benchmarks/chaos.py --only hang partition --steps 30 --out /tmp/chaos.md

Each row is one `rollart run` of the local shape (a trainer, two generators, two env-hosts, a reward
gateway; the tiny model; transformers generators, or vLLM for the vllm row; the trainer on one
device, or on fsdp2 with two rank processes for the kill-rank row) training `--steps`
steps while rollart/testkit/harness.py injects one kind of fault at random moments, again and again,
each after the cluster recovered from the last (see that module for the kinds and the checks).
A row's counts:

- injected: faults the harness injected (kills, hangs, partitions), or for the continuous kinds the
  faults that took effect (env calls that failed or timed out, by the env-hosts' count; reward
  workers that died mid-request, by the reward plugin's own log);
- survived: injected faults after which the cluster was whole again (every node answering, every
  session up) and trained another step; for continuous kinds, all of them when the run completed;
- lost: trajectories of environment seeds the trainer drew but never trained, never owes (its
  final checkpoint's retry line) and never gave up; duplicated: trajectories trained twice (the
  same trajectory id, or a second group of the same seed), both in the lineage of the final model;
- recovery: from the injection to the first step trained after the cluster was whole again.

The vllm row needs `.venv-vllm` (bin/setup-vllm); without it the row says so.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import describe  # noqa: E402 - benchmarks/machine.py

from rollart.testkit.harness import CONTINUOUS, FAULTS, ChaosRun  # noqa: E402
from rollart.testkit.outcome import NEEDS_RANKS, Outcome, Scenario  # noqa: E402
from rollart.tiny.model import ensure_tiny_model  # noqa: E402

ROW_ORDER = [*FAULTS, "kill-generator (vllm)"]


def scenarios(only: list[str], steps: int) -> list[Scenario]:
    rows = [Scenario(kind, (kind,), steps=steps, fsdp_ranks=2 if kind in NEEDS_RANKS else 0) for kind in FAULTS]
    # A vLLM generator takes 30-50 s to start again here, as long as 50 steps: three times the steps,
    # and faults only in the first third.
    rows.append(Scenario("vllm", ("kill-generator",), steps=3 * steps, quiet_steps=2 * steps, backend="vllm"))
    return [row for row in rows if not only or row.name in only]


def stats(values: list[float]) -> tuple[str, str]:
    if not values:
        return "-", "-"
    return f"{statistics.median(values):.1f}", f"{max(values):.1f}"


def row(outcome: Outcome) -> str:
    s = outcome.scenario
    kind = s.faults[0]
    if kind in CONTINUOUS:
        injected = sum(outcome.continuous.values())
        survived = injected if outcome.ok else 0
        p50, worst = "-", "-"
    else:
        injected = len(outcome.injections)
        survived = sum(1 for i in outcome.injections if i.recovery_s is not None)
        p50, worst = stats([i.recovery_s for i in outcome.injections if i.recovery_s is not None])
    fault = f"{kind} ({s.backend})" if s.backend != "hf" else kind
    checks = "all held" if outcome.ok else outcome.explain().replace("|", "/")
    return (
        f"| {fault} | {injected} | {survived} | {outcome.steps_trained} | {outcome.trajectories} | {outcome.lost} "
        f"| {outcome.duplicated} | {outcome.abandoned} | {p50} | {worst} | {checks} | {outcome.wall_s:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help=f"rows to run: {', '.join(FAULTS)}, vllm")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chaos.md")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "chaos", help="where the runs' folders go")
    args = parser.parse_args()
    began = time.monotonic()
    machine = describe(["torch", "transformers"])
    model = ensure_tiny_model(args.work / "model", seed=0)
    lines = []
    for scenario in scenarios(args.only, args.steps):
        if scenario.backend == "vllm" and not (ROOT / ".venv-vllm" / "bin" / "python").exists():
            lines.append(
                "| kill-generator (vllm) | - | - | - | - | - | - | - | - | - | not run: no .venv-vllm "
                "(bin/setup-vllm) | - |"
            )
            continue
        folder = args.work / f"{scenario.name}-{int(time.time())}"
        print(f"== {scenario.name}: {scenario.steps} steps, run folder {folder}", flush=True)
        outcome = asyncio.run(ChaosRun(scenario, folder, model).run())
        lines.append(row(outcome))
        print(lines[-1], flush=True)
    command = "python benchmarks/chaos.py" + "".join(f" {a}" for a in sys.argv[1:])
    took = f"took {time.monotonic() - began:.0f} s"
    commands = [f"- command: `{command}` (from the repository root; {took})"]
    dated = f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}"
    on = f"- machine: {machine}"
    if args.only and args.out.exists():  # a rerun of some rows: the others stay, with their command and machine
        old = args.out.read_text().splitlines()
        dated = next((line for line in old if line.startswith("- date")), dated)
        on = next((line for line in old if line.startswith("- machine")), on)
        commands = [line for line in old if line.startswith(("- command", "- rows"))] + [
            f"- rows {', '.join(args.only)} again: `{command}` "
            f"({datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; {took}; on {machine})"
        ]
        redone = {line.split(" | ")[0] for line in lines}
        kept = [
            line for line in old if line.startswith("| ") and "---" not in line and not line.startswith("| fault |")
        ]
        lines = [line for line in kept if line.split(" | ")[0] not in redone] + lines
        lines.sort(key=lambda line: ROW_ORDER.index(line.split(" | ")[0].removeprefix("| ")))
    header = (
        "| fault | injected | survived | steps | trajectories trained | lost | duplicated | seeds given up "
        "| recovery p50 s | recovery max s | invariants | wall s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Faults injected into real training runs\n\n"
        f"{dated}\n{on}\n"
        + "\n".join(commands)
        + "\n- shape: trainer, 2 generators (behind partition proxies), 2 env-hosts, reward gateway; tiny model; "
        "batch 2 groups of 2, alpha 1, checkpoint every 2 steps; heartbeat deadline 3 s; restart policy on-failure\n"
        "- what each column means, and each fault: benchmarks/chaos.py and rollart/testkit/harness.py\n\n"
        + header
        + "\n".join(lines)
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
