"""Fig. 12b: redundant environment rollouts under environment failures.

The Fig. 12a shape (simulation mode, real node processes, a simulated Qwen3-8B on 8 x H800, one
multi-turn task with lognormal env latency) run by RollArt (trajectory-level, alpha 1), with envs
that fail a fraction of their resets and steps. Without redundancy a failed trajectory fails its
group, which is run again from the start; with redundancy R each group starts G + R trajectories
and keeps the first G to finish, cancelling the rest, so a failure or a straggler costs nothing as
long as G others finish. Three runs: no failures (the bound), failures with R = 0, failures with R.

    .venv/bin/python benchmarks/paper/fig12b_redundancy.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time

from fig12a_env_handling import NODES, run_spec
from simrun import (
    ROOT,
    add_mode_arguments,
    mode_words,
    resolve_mode,
    run,
    save_plot,
    tiny_tokenizer_model,
    write_report,
)

PAPER = "up to 1.62x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--redundancy", type=int, default=2, help="extra trajectories per group")
    parser.add_argument("--reset-failure", type=float, default=0.02)
    parser.add_argument("--step-failure", type=float, default=0.01)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reset-s", type=float, default=5.0)
    parser.add_argument("--step-s", type=float, default=2.0)
    parser.add_argument("--cap-s", type=float, default=120.0)
    add_mode_arguments(parser, speedup=20.0, out=ROOT / "benchmarks" / "results" / "paper" / "fig12b.md")
    args = parser.parse_args()
    resolve_mode(args)
    model = tiny_tokenizer_model()
    began = time.monotonic()
    runs = {
        "no failures": (0.0, 0.0, 0),
        "failures, no redundancy": (args.reset_failure, args.step_failure, 0),
        f"failures, redundancy {args.redundancy}": (args.reset_failure, args.step_failure, args.redundancy),
    }
    measured = {}
    for name, (reset_failure, step_failure, redundancy) in runs.items():
        print(f"{name} ...", flush=True)
        spec = run_spec(args, args.sigma, "trajectory-level", model)
        spec["rollout"]["tasks"][0]["env_kwargs"] |= {"reset_failure": reset_failure, "step_failure": step_failure}
        spec["rollout"]["redundancy"] = redundancy
        measured[name] = run(spec, NODES, inprocess=args.inprocess)
        print(f"  step times (simulated s): {[round(s) for s in measured[name].step_s]}", flush=True)
    bound = measured["no failures"].mean_step_s
    plain = measured["failures, no redundancy"].mean_step_s
    lines = [
        "| run | step s | speed-up vs no redundancy | paper | efficiency (no-failure step / step) |",
        "|---|---:|---:|---|---:|",
    ]
    for name, result in measured.items():
        paper = PAPER if "redundancy" in name and "no redundancy" not in name else ""
        lines.append(
            f"| {name} | {result.mean_step_s:.0f} | {plain / result.mean_step_s:.2f}x | {paper} "
            f"| {bound / result.mean_step_s:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    shape = (
        f"the Fig. 12a shape (simulated Qwen3-8B on 8 x H800, batch {args.batch_groups} x {args.group_size}, "
        f"{args.turns} turns, env latency lognormal sigma {args.sigma:g}, median reset {args.reset_s} s / step "
        f"{args.step_s} s, cap {args.cap_s} s), RollArt alpha 1; env failures {args.reset_failure:.0%} of resets "
        f"and {args.step_failure:.0%} of steps; {args.steps} batches per run; {mode_words(args)}"
    )
    title = "Fig. 12b: redundant env rollouts under env failures (simulation)"
    write_report(args.out, title, began=began, shape=shape, body=table)
    speedups = {name: plain / result.mean_step_s for name, result in measured.items()}
    paper = {name: 1.62 for name in measured if "redundancy" in name and "no redundancy" not in name}
    save_plot(args.out, title + "\n(paper: its best case)", "speed-up over no redundancy", speedups, paper)


if __name__ == "__main__":
    main()
