"""Fig. 10: the synchronous baseline vs one-step-off async vs RollArt (alpha 1 and 2), on the paper's shape.

Simulation mode, real node processes, the paper's shape (`simrun.paper_run_spec`: Qwen3-32B, batch
512 = 64 groups of 8, a prefill-heavy game and a decode-heavy math task drawn uniformly, 96 H800 +
32 H20, a simulated 32-GPU trainer and a 200 Gb/s weight push). Four schedules, the same code:

- **sync** (veRL-like): batch-level env stepping, alpha 0; the trainer trains, pushes the weights
  and waits for the push before the next batch starts;
- **one-step-off** (StreamRL-like): batch-level env stepping, but the next batch is generated while
  the trainer trains (alpha 1), and the push is not waited for;
- **RollArt alpha 1 / alpha 2**: trajectory-level rollout, hardware-affinity routing, async push.

Reports step time (simulated seconds between batches) and throughput relative to sync, the paper's
figures beside them, and the bound for the async schedules: a step cannot be shorter than the
training step itself (the trainer is busy) nor than the batch's share of the rollout at full overlap.
The paper's end-to-end column is time to a score, which needs learning; simulation has no model
quality, so only step time and throughput are compared.

    .venv/bin/python benchmarks/paper/fig10_end_to_end.py            # about 10 minutes on 2 cores
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

MODES = {
    "sync (veRL-like)": {"schedule": "sync"},
    "one-step-off (StreamRL-like)": {"schedule": "async", "alpha": 1, "env_stepping": "batch"},
    "RollArt alpha 1": {"schedule": "async", "alpha": 1},
    "RollArt alpha 2": {"schedule": "async", "alpha": 2},
}
PAPER = {
    "sync (veRL-like)": "1.00x",
    "one-step-off (StreamRL-like)": "1.31-1.47x (e2e 1.52x)",
    "RollArt alpha 1": "2.65-4.58x (e2e 2.05x)",
    "RollArt alpha 2": "- (e2e 1.95x)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=6)
    add_mode_arguments(parser, speedup=10.0, out=ROOT / "benchmarks" / "results" / "paper" / "fig10.md")
    args = parser.parse_args()
    resolve_mode(args)
    model = tiny_tokenizer_model()
    began = time.monotonic()
    rows = []
    for mode, knobs in MODES.items():
        print(f"{mode} ...", flush=True)
        spec = paper_run_spec(model, speedup=args.speedup, steps=args.steps, **knobs)
        result = run(spec, PAPER_NODES, inprocess=args.inprocess)
        print(f"  step times (simulated s): {[round(s) for s in result.step_s]}", flush=True)
        rows.append((mode, result))
    sync_s = rows[0][1].mean_step_s
    lines = [
        "| schedule | step s | trajectories/s | speed-up vs sync | paper (throughput) | train step s "
        "| efficiency (train step / step) | groups dropped stale per batch | math share of trained (drawn 0.5) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for mode, result in rows:
        batch = 512
        lines.append(
            f"| {mode} | {result.mean_step_s:.0f} | {batch / result.mean_step_s:.2f} "
            f"| {sync_s / result.mean_step_s:.2f}x | {PAPER[mode]} | {train_step_s(result):.0f} "
            f"| {train_step_s(result) / result.mean_step_s:.2f} | {result.dropped_stale / args.steps:.1f} "
            f"| {task_share(result, 'math'):.2f} |"
        )
    rollart = dict(rows)["RollArt alpha 1"]
    verdict = "met" if sync_s / rollart.mean_step_s >= 2.05 else "missed"
    table = "\n".join(lines)
    best_mode, best = min(((m, r) for m, r in rows if m.startswith("RollArt")), key=lambda row: row[1].mean_step_s)
    bound = train_step_s(best)
    summary = (
        f"RollArt alpha 1 vs sync: {sync_s / rollart.mean_step_s:.2f}x (target >= 2.05x: {verdict}); "
        f"the faster RollArt schedule ({best_mode}) steps in {best.mean_step_s:.0f} s against a training step "
        f"of {bound:.0f} s (efficiency {bound / best.mean_step_s:.2f} of the trainer-bound step)"
    )
    print(table)
    print(summary)
    shape = (
        "`benchmarks/paper/simrun.py` `paper_run_spec` (Qwen3-32B, batch 64 x 8, game + math, "
        f"96 H800 + 32 H20, 32-GPU trainer, 200 Gb/s push); {args.steps} batches per schedule, step "
        f"time = mean gap between batches after the first; {mode_words(args)}"
    )
    title = "Fig. 10: synchronous vs one-step-off vs RollArt (simulation, the paper's shape)"
    write_report(args.out, title, began=began, shape=shape, body=f"{table}\n\n{summary}")
    speedups = {mode: sync_s / result.mean_step_s for mode, result in rows}
    paper = {"sync (veRL-like)": 1.0, "one-step-off (StreamRL-like)": 1.31, "RollArt alpha 1": 2.65}
    save_plot(args.out, title + "\n(paper: the low end of its throughput range)", "speed-up over sync", speedups, paper)


if __name__ == "__main__":
    main()
