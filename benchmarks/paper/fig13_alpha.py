"""Fig. 13: step time as the staleness bound alpha grows (0, 1, 2, 4), on the paper's shape.

Simulation mode, real node processes, `simrun.paper_run_spec` (Qwen3-32B, batch 512, game + math,
96 H800 + 32 H20, a simulated 32-GPU trainer). RollArt's trajectory-level rollout with async weight
push throughout; only alpha changes. alpha 0 lets no generation overlap training; each step of
alpha lets one more batch be generated ahead, and aborts fewer trajectories as stale. Reports the
mean step time, the speed-up over alpha 0, the training step (a floor for every alpha: the trainer
is busy), and the work staleness cost per batch: trajectories aborted as stale while running, and
groups that finished but went stale in the buffer (dropped, run again). Which of the two a stale
group lands in depends on timing alone (in-process runs abort more, multi-process runs drop more:
the multi-process hosts finish more groups before the version arrives), so the total is the number to compare.

    .venv/bin/python benchmarks/paper/fig13_alpha.py            # about 8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time

from simrun import (
    PAPER_NODES,
    ROOT,
    add_mode_arguments,
    mode_words,
    paper_run_spec,
    resolve_mode,
    run,
    save_plot,
    task_share,
    tiny_tokenizer_model,
    train_step_s,
    write_report,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--alphas", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=6)
    add_mode_arguments(parser, speedup=10.0, out=ROOT / "benchmarks" / "results" / "paper" / "fig13.md")
    args = parser.parse_args()
    resolve_mode(args)
    model = tiny_tokenizer_model()
    began = time.monotonic()
    rows = []
    for alpha in args.alphas:
        print(f"alpha {alpha} ...", flush=True)
        spec = paper_run_spec(model, speedup=args.speedup, steps=args.steps, schedule="async", alpha=alpha)
        result = run(spec, PAPER_NODES, inprocess=args.inprocess)
        print(f"  step times (simulated s): {[round(s) for s in result.step_s]}", flush=True)
        rows.append((alpha, result))
    base, group_size = rows[0][1].mean_step_s, spec["rollout"]["group_size"]
    lines = [
        "| alpha | step s | speed-up vs first | train step s | efficiency (train step / step) "
        "| stale per batch: trajectories aborted running | groups dropped finished | trajectories in all "
        "| math share of trained (drawn 0.5) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for alpha, result in rows:
        train = train_step_s(result)
        wasted = result.aborted_stale + result.dropped_stale * group_size
        lines.append(
            f"| {alpha} | {result.mean_step_s:.0f} | {base / result.mean_step_s:.2f}x | {train:.0f} "
            f"| {train / result.mean_step_s:.2f} | {result.aborted_stale / args.steps:.1f} "
            f"| {result.dropped_stale / args.steps:.1f} | {wasted / args.steps:.0f} "
            f"| {task_share(result, 'math'):.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    shape = (
        "`benchmarks/paper/simrun.py` `paper_run_spec`; trajectory-level rollout, async push; "
        f"{args.steps} batches per alpha, step time = mean gap between batches after the first; "
        f"{mode_words(args)}"
    )
    title = "Fig. 13: step time vs the staleness bound alpha (simulation, the paper's shape)"
    write_report(args.out, title, began=began, shape=shape, body=table)
    save_plot(args.out, title, "step s (simulated)", {f"alpha {alpha}": r.mean_step_s for alpha, r in rows})


if __name__ == "__main__":
    main()
