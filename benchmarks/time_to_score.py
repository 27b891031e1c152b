"""Time to score: the synchronous baseline vs RollArt async (alpha 1 and 2), training for real.

Each mode trains the tiny model on `configs/local.yaml`'s task mix, same seed and config, with
long-tailed env latency injected: every FrozenLake reset and step takes
`median * exp(sigma * N(0, 1))` seconds (the `slow` env wrapper, sigma 1 by default). The modes:

- `sync`: the veRL-like baseline (`schedule: sync`: alpha 0, batch-level env stepping, train,
  push the weights and wait for every generator, repeat);
- `async-1`, `async-2`: RollArt (`schedule: async`, trajectory-level rollout, alpha 1 or 2);
- `class`, `finish-time`: the config's own schedule, turns routed by hardware class or by predicted
  finish time (`rollout.routing`).

`--seeds 0,1,2` runs every mode once per rollout seed (seed by seed, the modes in turn) and adds the
mean per mode; `--median 0` leaves FrozenLake as the config has it (no latency added).

Each run lasts until its lake success rate (20-step moving average) reaches `--target` or
`--minutes` pass. Reports the time to reach the target, trajectories/s, generator busy fraction,
and the ratios to sync; writes `benchmarks/results/time_to_score.md` (with the command) and
`time_to_score.png` (success vs time, one line per mode).

    .venv/bin/python benchmarks/time_to_score.py                      # 3 runs of up to 15 min
    .venv/bin/python benchmarks/time_to_score.py --minutes 4 --target 0.3   # a shorter comparison
    .venv-vllm/bin/python benchmarks/time_to_score.py --modes class,finish-time --seeds 0,1,2 --median 0 \
        --backend vllm --minutes 8 --out benchmarks/results/router_time_to_score.md   # the default run, two routers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rollart.rundir import RunDir, read_jsonl
from rollart.testkit.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": {"schedule": "sync"},
    "async-1": {"schedule": "async", "alpha": 1},
    "async-2": {"schedule": "async", "alpha": 2},
    "class": {"routing": "class"},  # the config as it is, routed by hardware class (issue 23's check)
    "finish-time": {"routing": "finish-time"},  # ... by predicted finish time
}


def topology(base: dict[str, Any], folder: Path, mode: str, args: argparse.Namespace, seed: int | None = None) -> Path:
    """`configs/local.yaml` with this mode's schedule, slow FrozenLake, free ports and its own run dir
    (`seed`: the rollout's seed, in the run's name)."""
    data = json.loads(json.dumps(base))  # a deep copy
    run = data["run"]
    name = mode if seed is None else f"{mode}-seed{seed}"
    run["name"] = f"tts-{name}"
    run["run_dir"] = str(folder / name)
    run["drain_timeout_s"] = 10
    run["generator"] = {**run.get("generator", {}), "backend": args.backend}
    rollout = run["rollout"]
    rollout.update(MODES[mode])
    rollout["steps"] = args.max_steps
    if seed is not None:
        rollout["seed"] = seed
    for task in rollout["tasks"]:
        if task["env"] == "frozen-lake" and args.median > 0:  # --median 0: the config's env as it is
            inner = task.get("env_kwargs", {})
            task["env"] = "slow"
            task["env_kwargs"] = {"inner": "frozen-lake", "median_s": args.median, "sigma": args.sigma, **inner}
    ports = free_ports(2 * len(data["nodes"]))
    for i, node in enumerate(data["nodes"]):
        node["port"], node["admin_port"] = ports[2 * i], ports[2 * i + 1]
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    # lenient: the run is read while it writes, and a cut line is skipped
    return [record for record in read_jsonl(RunDir(run_dir).metrics, lenient=True) if "step" in record]


def run_mode(
    base: dict[str, Any], folder: Path, mode: str, args: argparse.Namespace, seed: int | None = None
) -> dict[str, Any]:
    name = mode if seed is None else f"{mode}-seed{seed}"
    if args.report_only:
        return summarize(folder / name, name, args)
    path = topology(base, folder, mode, args, seed)
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
    run_dir = folder / name
    # A fresh run: left in place, an earlier run's checkpoint would be resumed and its metrics read as this one's.
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "run", str(path), "--duration", str(args.minutes * 60)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    reached: float | None = None
    try:
        while proc.poll() is None:
            time.sleep(5)
            if RunDir(run_dir).metrics.exists():
                reached = time_to_target(read_metrics(run_dir), args.task, args.target)
                if reached is not None:
                    proc.terminate()  # the launcher drains the nodes
                    break
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return summarize(run_dir, name, args)


def summarize(run_dir: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    metrics = read_metrics(run_dir)
    busy = [v for m in metrics for v in m.get("generator_busy", {}).values()]
    span = metrics[-1]["elapsed_s"] - metrics[0]["elapsed_s"] if len(metrics) > 1 else float("nan")
    trajectories = sum(sum(t["count"] for t in m["tasks"].values()) for m in metrics[1:])
    return {
        "mode": mode,
        "steps": len(metrics),
        "reached_s": time_to_target(metrics, args.task, args.target),
        "first_step_s": metrics[0]["elapsed_s"] if metrics else None,
        "traj_per_s": trajectories / span if span and span > 0 else float("nan"),
        "busy": sum(busy) / len(busy) if busy else float("nan"),
        "staleness": max((m.get("staleness_max", 0) for m in metrics), default=0),
        "curve": [(m["elapsed_s"], m["tasks"].get(args.task, {}).get("success_ma")) for m in metrics],
        "final": metrics[-1]["tasks"].get(args.task, {}).get("success_ma") if metrics else None,
    }


def mean_lines(results: list[dict[str, Any]], modes: list[str], seeds: list[int | None], target: float) -> str:
    """Per mode, over the seeds: the mean time from the first step to `target` (runs that reached it)."""
    lines = [
        f"| mode | seeds reaching {target} | mean s from the first step to it | each seed |",
        "|---|---:|---:|---|",
    ]
    for mode in modes:
        runs = [r for r in results if r["mode"] == mode or r["mode"].startswith(f"{mode}-seed")]
        times = [r["reached_s"] - r["first_step_s"] for r in runs if r["reached_s"] is not None]
        each = ", ".join(
            f"{r['reached_s'] - r['first_step_s']:.0f}" if r["reached_s"] is not None else "-" for r in runs
        )
        mean = f"{sum(times) / len(times):.0f}" if times else "-"
        lines.append(f"| {mode} | {len(times)} of {len(seeds)} | {mean} | {each} |")
    return "\n".join(lines)


def time_to_target(metrics: list[dict[str, Any]], task: str, target: float) -> float | None:
    for m in metrics:
        numbers = m["tasks"].get(task)
        if numbers is not None and m["step"] >= 20 and numbers["success_ma"] >= target:
            return float(m["elapsed_s"])
    return None


def plot(results: list[dict[str, Any]], target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        points = [(t / 60, s) for t, s in result["curve"] if s is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=result["mode"])
    ax.axhline(target, linestyle=":", color="grey", label=f"target {target}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("success rate (20-step moving average)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: sync, async-1, async-2")
    parser.add_argument("--minutes", type=float, default=15.0, help="cap per run")
    parser.add_argument("--target", type=float, default=0.8, help="success rate to reach (20-step average)")
    parser.add_argument("--task", default="lake", help="the task whose success rate is the score")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of env latency")
    parser.add_argument("--median", type=float, default=0.05, help="median env call latency, seconds (0: none added)")
    parser.add_argument("--backend", default="hf", help="generator backend (hf or vllm)")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "time_to_score.md")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the last runs' folders")
    parser.add_argument(
        "--seeds", help="comma-separated rollout seeds: each mode once per seed (default: the config's)"
    )
    args = parser.parse_args()
    base = yaml.safe_load(args.config.read_text())
    folder = ROOT / "runs" / "bench-time-to-score"
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    results = []
    seeds: list[int | None] = [int(s) for s in args.seeds.split(",")] if args.seeds else [None]
    for seed in seeds:  # seed by seed, the modes in turn: a drift of the machine's speed hits each mode alike
        for mode in args.modes.split(","):
            print(f"{mode} (seed {seed}): training (up to {args.minutes:g} min) ...", flush=True)
            results.append(run_mode(base, folder, mode, args, seed))
            print(f"  {results[-1]['steps']} steps, reached {args.target} at {results[-1]['reached_s']}", flush=True)

    sync = next((r for r in results if r["mode"] == "sync"), None)

    def ratio(value: float | None, reference: float | None, *, inverse: bool = False) -> str:
        if value is None or reference is None or not value or not reference:
            return "-"
        return f"{(reference / value if inverse else value / reference):.2f}x"

    def from_first(r: dict[str, Any]) -> float | None:
        return r["reached_s"] - r["first_step_s"] if r["reached_s"] is not None else None

    lines = [
        f"| mode | steps | time to {args.target}, s from start | from the first step | speed-up vs sync "
        "| traj/s | vs sync | generator busy | max staleness | final success |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        reached = f"{r['reached_s']:.0f}" if r["reached_s"] is not None else f"not in {args.minutes:g} min"
        first = f"{from_first(r):.0f}" if r["reached_s"] is not None else "-"
        final = f"{r['final']:.2f}" if r["final"] is not None else "-"
        lines.append(
            f"| {r['mode']} | {r['steps']} | {reached} | {first} "
            f"| {ratio(from_first(r), from_first(sync) if sync else None, inverse=True)} "
            f"| {r['traj_per_s']:.2f} | {ratio(r['traj_per_s'], sync['traj_per_s'] if sync else None)} "
            f"| {r['busy']:.2f} | {r['staleness']} | {final} |"
        )
    table = "\n".join(lines)
    if len(seeds) > 1:
        table += "\n\n" + mean_lines(results, args.modes.split(","), seeds, args.target)
    print(table)
    png = args.out.with_suffix(".png")
    plot(results, args.target, png)
    command = " ".join(["python", "benchmarks/time_to_score.py", *sys.argv[1:]])
    latency = (
        f"FrozenLake env calls take median {args.median} s x lognormal(sigma {args.sigma})"
        if args.median > 0
        else "FrozenLake as the config has it (no latency added)"
    )
    report = (
        f"# Time to score: {', '.join(args.modes.split(','))}\n\n"
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: nproc {os.cpu_count()}, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}\n"
        f"- command: `{command}` (from the repository root; took {time.monotonic() - began:.0f} s)\n"
        f"- shape: {args.config.name}'s tasks and model, generator backend {args.backend}; {latency}; "
        f"score = {args.task} success rate, 20-step moving average (counted from step 20 on), "
        f"target {args.target}; each run capped at "
        f"{args.minutes:g} min. Time from start includes the trainer's start-up (model load, and the "
        "random-policy baseline, measured on the slow env before training began); the speed-up compares "
        "the time from the first trained step\n\n"
        f"{table}\n\n![success vs time]({png.name})\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
