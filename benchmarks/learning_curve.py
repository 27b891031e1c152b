"""Summarize training runs' learning curves from their `metrics.jsonl`, side by side.

For each run and task: the random-policy baseline (the file's first line), the mean reward and
success rate over the task's trajectories in the first and the last `--window` steps, and the step and
`elapsed_s` (seconds since the trainer started) at which the task's 20-step moving average
(`success_ma`, or `reward_ma` for `--reward-target`) first reaches the target.

    .venv/bin/python benchmarks/learning_curve.py runs/local/metrics.jsonl
    .venv/bin/python benchmarks/learning_curve.py benchmarks/results/local_run/*metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def load(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The baseline line and the step lines of one run."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    baseline = next((line["tasks"] for line in lines if line.get("baseline")), {})
    return baseline, [line for line in lines if "step" in line]


def first_reaching(steps: list[dict[str, Any]], task: str, key: str, target: float) -> str:
    """'step N (S s)' where the task's moving average `key` first reaches `target`, or 'not reached'."""
    for line in steps:
        if line["tasks"].get(task, {}).get(key, float("-inf")) >= target:
            return f"step {line['step']} ({line['elapsed_s']:.0f} s)"
    return "not reached"


def summarize(path: Path, *, window: int, success_target: float, reward_target: float) -> list[list[str]]:
    baseline, steps = load(path)
    rows = []
    for task in sorted({name for line in steps for name in line["tasks"]}):
        had = [line["tasks"][task] for line in steps if task in line["tasks"]]
        first = [line["tasks"][task] for line in steps[:window] if task in line["tasks"]]
        last = [line["tasks"][task] for line in steps[-window:] if task in line["tasks"]]

        def mean(part: list[dict[str, Any]], key: str) -> str:
            """Over the part's trajectories (each step weighted by how many it had)."""
            if not part:
                return "-"
            return f"{statistics.fmean([t[key] for t in part], weights=[t['count'] for t in part]):.3f}"

        base = baseline.get(task, {})
        rows.append(
            [
                str(path),
                task,
                f"{base.get('reward_mean', float('nan')):.3f} / {base.get('success_rate', float('nan')):.3f}",
                f"{mean(first, 'reward_mean')} / {mean(first, 'success_rate')}",
                f"{mean(last, 'reward_mean')} / {mean(last, 'success_rate')}",
                f"{len(had)} of {len(steps)}",
                first_reaching(steps, task, "success_ma", success_target),
                first_reaching(steps, task, "reward_ma", reward_target),
                f"{steps[-1]['elapsed_s']:.0f} s" if steps else "-",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files of training runs")
    parser.add_argument("--window", type=int, default=20, help="steps averaged at the start and the end")
    parser.add_argument("--success-target", type=float, default=0.8)
    parser.add_argument("--reward-target", type=float, default=0.5)
    args = parser.parse_args()
    header = [
        "run",
        "task",
        "baseline reward / success",
        f"first {args.window} steps",
        f"last {args.window} steps",
        "steps with task",
        f"success_ma >= {args.success_target}",
        f"reward_ma >= {args.reward_target}",
        "last step at",
    ]
    rows = [
        row
        for path in args.metrics
        for row in summarize(
            path, window=args.window, success_target=args.success_target, reward_target=args.reward_target
        )
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
