"""The run report: plots and a summary table from the JSONL files a training run writes.

    rollart report RUN_DIR [--out DIR]     (default DIR: RUN_DIR/report)

Reads `metrics.jsonl` (required: one line per training step, optionally preceded by a
`{"baseline": true, ...}` random-policy record and a `{"run": ...}` header), and, when present,
`timeline.jsonl` (one line per trained trajectory, with its gen/env/reward spans) and
`utilization.jsonl` (generator busy samples). Writes `reward_success.png`, `step_time.png`,
`utilization.png`, `timeline.png` and `report.md`. A truncated last line (a killed run) is skipped; lines of an
unknown kind and missing optional keys are tolerated.

One piece: every plot and the summary are drawn from the same `RunData`, in the order `build_report`
writes them; read top to bottom it is the report.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart import step_times
from rollart.rundir import RunDir, RunDirError, read_jsonl

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Record = dict[str, Any]

MOVING_WINDOW = 20
SUCCESS_TARGET = 0.8
TIMELINE_MAX_TRAJECTORIES = 200
SPAN_COLORS = {"gen": "tab:blue", "env": "tab:orange", "reward": "tab:green"}
ALL_TASKS = "all"  # the series name when steps carry no per-task breakdown


ReportError = RunDirError
"""The run directory cannot be reported on (no metrics, or a corrupt line); the message says which file.
The run folder's own error: `read_jsonl` raises it for a corrupt line."""


@dataclass
class RunData:
    """What a run directory holds, parsed: step records in order, the baseline per task, and the optional logs."""

    steps: list[Record]
    baseline: dict[str, Record] = field(default_factory=dict)
    timeline: list[Record] = field(default_factory=list)
    utilization: list[Record] = field(default_factory=list)
    evals: list[Record] = field(default_factory=list)
    """Held-out evaluation lines (`{"eval": true, ...}`), in order."""


def load_run(run_dir: Path) -> RunData:
    files = RunDir(run_dir)
    metrics_path = files.metrics
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path}: no such file; is {run_dir} the directory of a training run?")
    run = RunData(steps=[])
    for record in read_jsonl(metrics_path):
        if record.get("baseline"):
            run.baseline = dict(record.get("tasks") or {})
        elif record.get("eval"):
            run.evals.append(record)
        elif "step" in record:
            run.steps.append(record)
    for path, name in ((files.timeline, "timeline"), (files.utilization, "utilization")):
        if path.is_file():
            setattr(run, name, read_jsonl(path))
    return run


def moving_average(values: list[float], window: int = MOVING_WINDOW) -> list[float]:
    """Trailing mean over the last `window` values; at the start, the mean of what is there so far."""
    averages: list[float] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averages.append(total / min(i + 1, window))
    return averages


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def task_series(steps: list[Record], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per task, (elapsed minutes, value of `key`) over the steps that report it; steps with no
    per-task breakdown contribute their top-level value under the task `all`."""
    series: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for step in steps:
        elapsed = _number(step.get("elapsed_s"))
        if elapsed is None:
            continue
        tasks = step.get("tasks") or {ALL_TASKS: step}
        for task, stats in tasks.items():
            value = _number(stats.get(key)) if isinstance(stats, dict) else None
            if value is not None:
                series[task][0].append(elapsed / 60)
                series[task][1].append(value)
    return dict(series)


def busy_series(run: RunData) -> dict[str, tuple[list[float], list[float]]]:
    """Per generator, (minutes, busy fraction): utilization.jsonl, else the per-step generator_busy."""
    series: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for sample in run.utilization:
        t, busy = _number(sample.get("t")), _number(sample.get("busy"))
        if t is not None and busy is not None and "generator" in sample:
            series[str(sample["generator"])][0].append(t / 60)
            series[str(sample["generator"])][1].append(busy)
    if not series:
        for step in run.steps:
            elapsed = _number(step.get("elapsed_s"))
            for generator, value in (step.get("generator_busy") or {}).items():
                busy = _number(value)
                if elapsed is not None and busy is not None:
                    series[generator][0].append(elapsed / 60)
                    series[generator][1].append(busy)
    return dict(series)


def _new_figure(width: float, height: float) -> Figure:
    # A bare Figure renders with Agg on savefig and touches no pyplot state, so building a report
    # inside a notebook or a GUI process neither switches its backend nor leaks open figures.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_reward_success(run: RunData, path: Path) -> None:
    fig = _new_figure(10, 7)
    reward_ax, success_ax = fig.subplots(2, 1, sharex=True)
    panels = [(reward_ax, "reward_mean", "mean reward"), (success_ax, "success_rate", "success rate")]
    for ax, key, label in panels:
        series = task_series(run.steps, key)
        for i, (task, (minutes, values)) in enumerate(sorted(series.items())):
            color = f"C{i % 10}"
            ax.plot(minutes, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(
                minutes, moving_average(values), color=color, linewidth=2, label=f"{task} ({MOVING_WINDOW}-step avg)"
            )
            baseline = _number((run.baseline.get(task) or {}).get(key))
            if baseline is not None:
                ax.axhline(baseline, color=color, linestyle="--", linewidth=1, label=f"{task} random policy")
        if not series:
            _no_data(ax, f"no {key} in {RunDir.METRICS}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    success_ax.axhline(SUCCESS_TARGET, color="black", linestyle=":", linewidth=1, label=f"target {SUCCESS_TARGET}")
    success_ax.set_ylim(-0.02, 1.02)
    success_ax.set_xlabel("elapsed (minutes)")
    for ax in (reward_ax, success_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    fig.suptitle("Reward and success per task")
    fig.savefig(path, dpi=100)


def step_intervals(steps: list[Record]) -> list[tuple[int, float, Record]]:
    """(step, seconds since the step before, line) for every step after the first (whose interval
    holds the start-up)."""
    out = []
    for before, line in itertools.pairwise(steps):
        a, b = _number(before.get("elapsed_s")), _number(line.get("elapsed_s"))
        if a is not None and b is not None:
            out.append((int(line.get("step", 0)), b - a, line))
    return out


def plot_step_time(run: RunData, path: Path) -> None:
    """Per step, the trainer's time from the step before stacked by part (`rollart.step_times`);
    below, what ran beside it: the weight push and apply, and a trajectory's generation, env and
    reward time (mean per trajectory of the batch)."""
    fig = _new_figure(10, 7)
    stack_ax, beside_ax = fig.subplots(2, 1, sharex=True)
    intervals = step_intervals(run.steps)
    xs = [step for step, _, _ in intervals]
    split = [step_times.parts(line, interval) for _, interval, line in intervals]
    bottom = [0.0] * len(intervals)
    for i, name in enumerate([*step_times.PARTS, "other"]):
        heights = [parts[name] for parts in split]
        stack_ax.bar(xs, heights, bottom=bottom, width=0.9, color=f"C{i % 10}", label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, (name, key) in enumerate(step_times.BESIDE.items()):
        values = [float(line.get(key) or 0.0) for _, _, line in intervals]
        if any(values):
            beside_ax.plot(xs, values, color=f"C{i % 10}", linewidth=1.2, label=name)
    if not intervals:
        _no_data(stack_ax, f"fewer than two steps in {RunDir.METRICS}")
    stack_ax.set_ylabel("seconds (trainer)")
    stack_ax.set_title("Where each step's time went (from the step before; the first step's start-up left out)")
    beside_ax.set_ylabel("seconds (beside it)")
    beside_ax.set_xlabel("step")
    for ax in (stack_ax, beside_ax):
        ax.grid(alpha=0.3, axis="y")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper left", ncols=4)
    fig.savefig(path, dpi=100)


def plot_utilization(run: RunData, path: Path) -> None:
    fig = _new_figure(10, 4)
    ax = fig.subplots()
    series = busy_series(run)
    for generator, (minutes, busy) in sorted(series.items()):
        ax.plot(minutes, busy, linewidth=1.2, label=generator)
    if series:
        ax.legend(fontsize="small", loc="lower right")
    else:
        _no_data(ax, f"no {RunDir.UTILIZATION} and no generator_busy in {RunDir.METRICS}")
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("elapsed (minutes)")
    ax.set_ylabel("busy fraction")
    ax.set_title("Generator utilization")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)


def plot_timeline(run: RunData, path: Path, max_trajectories: int = TIMELINE_MAX_TRAJECTORIES) -> None:
    """One row per trajectory (the last `max_trajectories` by start), its spans colored by kind and
    idle gaps left blank, as in Figure 7 of the RollArt paper; dotted lines mark training steps."""
    trajectories = [t for t in run.timeline if _number(t.get("started_at")) is not None]
    trajectories = sorted(trajectories, key=lambda t: float(t["started_at"]))[-max_trajectories:]
    fig = _new_figure(12, min(12.0, 2.5 + 0.04 * len(trajectories)))
    ax = fig.subplots()
    bars: dict[str, tuple[list[int], list[float], list[float]]] = defaultdict(lambda: ([], [], []))
    for row, trajectory in enumerate(trajectories):
        for span in trajectory.get("spans") or []:
            if len(span) == 3 and _number(span[1]) is not None and _number(span[2]) is not None:
                kind = span[0] if span[0] in SPAN_COLORS else "other"
                bars[kind][0].append(row)
                bars[kind][1].append(float(span[1]))
                bars[kind][2].append(float(span[2]) - float(span[1]))
    for kind in [*SPAN_COLORS, "other"]:
        if kind in bars:
            rows, starts, widths = bars[kind]
            color = SPAN_COLORS.get(kind, "tab:gray")
            ax.barh(rows, widths, left=starts, height=0.8, color=color, linewidth=0, label=kind)
    if trajectories:
        first = float(trajectories[0]["started_at"])
        last = max(_number(t.get("finished_at")) or float(t["started_at"]) for t in trajectories)
        step_times = [e for s in run.steps if (e := _number(s.get("elapsed_s"))) is not None and first <= e <= last]
        for i, t in enumerate(step_times):
            ax.axvline(
                t, color="black", linestyle=":", linewidth=0.7, alpha=0.6, label="training step" if i == 0 else None
            )
        ax.set_ylim(len(trajectories) - 0.5, -0.5)  # earliest start on top
        ax.legend(fontsize="small", loc="upper right")
        skipped = len(run.timeline) - len(trajectories)
        more = f" (the last {len(trajectories)} of {len(run.timeline)})" if skipped > 0 else ""
        ax.set_title(f"Trajectory timeline{more}")
    else:
        _no_data(ax, f"no {RunDir.TIMELINE} in the run directory")
        ax.set_title("Trajectory timeline")
    ax.set_yticks([])
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("trajectory (by start)")
    fig.savefig(path, dpi=100)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def summary_markdown(run: RunData, plots: list[str]) -> str:
    """The report's text: run totals, the final moving averages per task against the random-policy
    baseline, throughput, generator busy fraction (mean of its samples) and staleness."""
    steps = run.steps
    elapsed = max((e for s in steps if (e := _number(s.get("elapsed_s"))) is not None), default=None)
    elapsed_text = "n/a" if elapsed is None else f"{elapsed:.1f} s ({elapsed / 60:.1f} min)"
    traj_per_s = _mean([v for s in steps if (v := _number(s.get("traj_per_s"))) is not None])
    staleness = [v for s in steps if (v := _number(s.get("staleness_max"))) is not None]
    mismatch = [v for s in steps if (v := _number(s.get("mismatch_kl"))) is not None]
    fresh_ratio = [v for s in steps if (v := _number(s.get("mismatch_ratio_max"))) is not None]
    last_step = steps[-1].get("step", "n/a") if steps else "n/a"
    lines = [
        "# Run report",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {len(steps)} (last step {last_step}) |",
        f"| elapsed | {elapsed_text} |",
        f"| mean traj/s | {_fmt(traj_per_s, 2)} |",
        f"| max staleness | {_fmt(max(staleness), 0) if staleness else 'n/a'} |",
        f"| generator/trainer mismatch at zero staleness: mean KL, max ratio | {_fmt(_mean(mismatch), 5)}, "
        f"{_fmt(max(fresh_ratio), 4) if fresh_ratio else 'n/a'} |",
        "",
        f"## Per task (final {MOVING_WINDOW}-step moving average)",
        "",
        "| task | steps | success | baseline success | reward | baseline reward |",
        "|---|---|---|---|---|---|",
    ]
    successes, rewards = task_series(steps, "success_rate"), task_series(steps, "reward_mean")
    for task in sorted(successes.keys() | rewards.keys() | run.baseline.keys()):
        success = successes.get(task, ([], []))[1]
        reward = rewards.get(task, ([], []))[1]
        base = run.baseline.get(task) or {}
        lines.append(
            f"| {task} | {max(len(success), len(reward))} "
            f"| {_fmt(moving_average(success)[-1] if success else None)} | {_fmt(_number(base.get('success_rate')))} "
            f"| {_fmt(moving_average(reward)[-1] if reward else None)} | {_fmt(_number(base.get('reward_mean')))} |"
        )
    intervals = step_intervals(steps)
    if intervals:
        lines += ["", "## Where a step's time went (median over steps, seconds)", ""]
        split = [step_times.parts(line, interval) for _, interval, line in intervals]
        names = list(split[0])
        beside = list(step_times.BESIDE.items())
        lines += ["| step | " + " | ".join(names) + " | " + " | ".join(name for name, _ in beside) + " |"]
        lines += ["|---" * (1 + len(names) + len(beside)) + "|"]
        medians = [_fmt(_median([p[name] for p in split]), 2) for name in names]
        medians += [_fmt(_median([float(line.get(key) or 0.0) for _, _, line in intervals]), 2) for _, key in beside]
        lines += [f"| {_fmt(_median([interval for _, interval, _ in intervals]), 2)} | " + " | ".join(medians) + " |"]
    busy = {generator: _mean(values) for generator, (_, values) in sorted(busy_series(run).items())}
    lines += ["", "## Generator busy fraction (mean)", "", "| generator | busy |", "|---|---|"]
    lines += [f"| {generator} | {_fmt(value)} |" for generator, value in busy.items()]
    all_busy = [v for v in busy.values() if v is not None]
    lines.append(f"| **all** | {_fmt(_mean(all_busy))} |")
    lines += eval_markdown(run.evals)
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def eval_series(evals: list[Record]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Per eval task, per figure (`pass@1`, `pass@4`, ...): (steps, values)."""
    series: dict[str, dict[str, tuple[list[int], list[float]]]] = defaultdict(lambda: defaultdict(lambda: ([], [])))
    for line in evals:
        step = line.get("step")
        for task, figures in (line.get("tasks") or {}).items():
            for key, value in figures.items():
                if "@" in key and isinstance(step, int) and (number := _number(value)) is not None:
                    series[task][key][0].append(step)
                    series[task][key][1].append(number)
    return series


def eval_markdown(evals: list[Record]) -> list[str]:
    """The held-out evaluations as a table: one row per round, a column per task and figure."""
    series = eval_series(evals)
    if not series:
        return []
    columns = [(task, key) for task in sorted(series) for key in sorted(series[task])]
    lines = ["", "## Held-out evaluation (problems each round; pass@1 greedy, pass@k sampled)", ""]
    lines += ["| step | version | " + " | ".join(f"{task} {key}" for task, key in columns) + " |"]
    lines += ["|---" * (2 + len(columns)) + "|"]
    for line in evals:
        by_task = line.get("tasks") or {}
        cells = [_fmt(_number((by_task.get(task) or {}).get(key))) for task, key in columns]
        lines.append(f"| {line.get('step')} | {line.get('version')} | " + " | ".join(cells) + " |")
    return lines


def plot_eval(run: RunData, path: Path) -> None:
    fig = _new_figure(10, 4)
    ax = fig.subplots()
    for i, (task, figures) in enumerate(sorted(eval_series(run.evals).items())):
        for j, (key, (steps, values)) in enumerate(sorted(figures.items())):
            style = ["-", "--", ":"][j % 3]
            ax.plot(steps, values, color=f"C{i % 10}", linestyle=style, marker="o", label=f"{task} {key}")
    if not run.evals:
        _no_data(ax, "no held-out evaluation (run.rollout.eval)")
    else:
        ax.legend(fontsize="small", loc="best")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("share of problems solved")
    ax.grid(alpha=0.3)
    fig.suptitle("Held-out evaluation")
    fig.savefig(path, dpi=100)


def build_report(run_dir: Path, out: Path | None = None) -> Path:
    """Read the run directory, write the plots and `report.md` into `out` (default RUN_DIR/report)
    and return `out`. Raises `ReportError` naming `metrics.jsonl` when the run has none."""
    run = load_run(run_dir)
    out = RunDir(run_dir).report if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    plotters = {
        "reward_success.png": plot_reward_success,
        "step_time.png": plot_step_time,
        "utilization.png": plot_utilization,
        "timeline.png": plot_timeline,
    }
    if run.evals:
        plotters["eval.png"] = plot_eval
    for name, plot in plotters.items():
        plot(run, out / name)
    (out / "report.md").write_text(summary_markdown(run, list(plotters)), encoding="utf-8")
    return out
