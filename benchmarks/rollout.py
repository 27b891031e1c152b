"""Rollout benchmark: trajectory-level vs batch-level env stepping under env latency spread.

Runs the real nodes (`rollart run`, one process per node, the tiny model on the transformers
backend) on FrozenLake whose every reset and step takes `median * exp(sigma * N(0, 1))` seconds
(the `slow` env), for sigma in {0.5, 1, 2}, once with RollArt's trajectory-level rollout and once
with batch-level env stepping (every turn waits for the whole batch, as synchronous systems do),
the two modes interleaved so machine noise hits both. Same code, same config but the stepping.

Reports trajectories/s, the ratio trajectory-level / batch-level, and the generator's busy
fraction over the run, and writes them with the command to `benchmarks/results/rollout.md`.

    .venv/bin/python benchmarks/rollout.py            # about 5 minutes on 2 cores (3 batches per run)
    .venv/bin/python benchmarks/rollout.py --quick    # one sigma, fewer steps: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart.rundir import RunDir
from rollart.testkit.topology import TopologyBuilder

ROOT = Path(__file__).resolve().parents[1]
NODES = {"trainer": "trainer", "gen-0": "generator", "env-0": "env-host", "reward": "reward-gateway"}


def topology(folder: Path, model: Path, *, stepping: str, sigma: float, steps: int, median_s: float) -> Path:
    builder = TopologyBuilder(
        folder / "run",
        name="bench",
        drain_timeout_s=5,
        restart={"policy": "stop-all"},
        model={"path": model},
        generator={"backend": "hf"},
        reward_pool={"min_workers": 1, "max_workers": 1},
        rollout={
            "tasks": [
                {
                    "name": "lake",
                    "env": "slow",
                    "env_kwargs": {
                        "inner": "frozen-lake",
                        "size": 3,
                        "median_s": median_s,
                        "sigma": sigma,
                        "cap_s": 10.0,
                    },
                    "max_turns": 4,
                    "max_tokens_per_turn": 12,
                }
            ],
            "group_size": 4,
            "redundancy": 0,
            "batch_groups": 4,
            "alpha": 1,
            "steps": steps,
            "groups_per_env_host": 4,
            "env_stepping": stepping,
        },
    )
    for name, role in NODES.items():
        builder.node(name, role)
    return builder.write(folder / "topology.yaml")


def run_once(model: Path, *, stepping: str, sigma: float, steps: int, median_s: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="rollart-bench-") as tmp:
        folder = Path(tmp)
        path = topology(folder, model, stepping=stepping, sigma=sigma, steps=steps, median_s=median_s)
        env = {k: v for k, v in os.environ.items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
        result = subprocess.run(
            [sys.executable, "-m", "rollart.cli", "run", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if result.returncode != 0:
            raise SystemExit(f"run failed ({stepping}, sigma {sigma}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
        run_dir = RunDir(folder / "run")
        groups = [json.loads(line)["group"] for line in run_dir.rollout.read_text().splitlines()]
        trajectories = [t for g in groups for t in g["trajectories"]]
        start = min(t["started_at"] for t in trajectories)
        end = max(t["finished_at"] for t in trajectories)
        summary = _last_event(run_dir.node_log("gen-0"), "generator.summary")
        window = end - start
        return {
            "trajectories": len(trajectories),
            "seconds": window,
            "trajectories_per_s": len(trajectories) / window,
            "busy_fraction": min(1.0, summary.get("busy_s", 0.0) / window),
            "env_wait_s": sum(t["env_wait_s"] for t in trajectories) / len(trajectories),
        }


def _last_event(log: Path, event: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            found = json.loads(line)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="sigma 1 only, 2 steps: a smoke run")
    parser.add_argument("--steps", type=int, default=3, help="batches per run")
    parser.add_argument("--median", type=float, default=0.2, help="median env call latency, seconds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollout.md")
    args = parser.parse_args()
    sigmas = [1.0] if args.quick else [0.5, 1.0, 2.0]
    steps = 2 if args.quick else args.steps

    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(ROOT / ".cache" / "models" / "tiny-qwen3", seed=0)
    began = time.monotonic()
    rows = []
    for sigma in sigmas:
        measured = {}
        for stepping in ("trajectory", "batch"):
            print(f"sigma {sigma}: {stepping}-level ...", flush=True)
            measured[stepping] = run_once(model, stepping=stepping, sigma=sigma, steps=steps, median_s=args.median)
        rows.append((sigma, measured["trajectory"], measured["batch"]))

    header = (
        "| sigma | trajectory-level traj/s | batch-level traj/s | ratio | generator busy (traj / batch) "
        "| env wait per traj s (traj / batch) |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---:|"]
    for sigma, traj, batch in rows:
        lines.append(
            f"| {sigma} | {traj['trajectories_per_s']:.2f} | {batch['trajectories_per_s']:.2f} "
            f"| {traj['trajectories_per_s'] / batch['trajectories_per_s']:.2f}x "
            f"| {traj['busy_fraction']:.2f} / {batch['busy_fraction']:.2f} "
            f"| {traj['env_wait_s']:.2f} / {batch['env_wait_s']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    command = " ".join(["python", "benchmarks/rollout.py", *sys.argv[1:]])
    shape = (
        f"FrozenLake (max 4 turns, 12 tokens per turn) wrapped in `slow` (median {args.median} s per env call, "
        f"cap 10 s, 3x3 lake); 1 generator (transformers backend, tiny Qwen3), "
        "1 env-host running 4 groups of 4 at once, "
        f"batch 4 groups, alpha 1, {steps} batches per run; trajectories/s over the span from the first "
        "trajectory's start to the last one's end"
    )
    report = (
        "# Rollout benchmark: trajectory-level vs batch-level env stepping\n\n"
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: nproc {os.cpu_count()}, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}\n"
        f"- command: `{command}` (from the repository root; took {time.monotonic() - began:.0f} s)\n"
        f"- shape: {shape}\n\n{table}\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
