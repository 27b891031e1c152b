"""Fig. 11b: asynchronous vs synchronous cross-cluster weight sync.

The paper's shape (`simrun.paper_run_spec`: Qwen3-32B, batch 512, game + math, 64 H800 + 32 H20
generating as 12 engines of 8, a simulated 32-H800 trainer, RollArt alpha 1), the weights crossing
a 200 Gb/s Ethernet link to the generators, one copy per engine:

- **sync push** (veRL's NCCL broadcast): after each step the trainer sends the weights to every
  engine and waits; the engines stop generating while they receive;
- **async push** (the paper's Mooncake store): the trainer hands the weights off and goes on; each
  engine receives them in the background and stops only to load them from host memory;
- **bound**: the same run with a weight push that costs nothing.

In-process on a virtual clock (`rollart.launch.inprocess`). Reports step time, the speed-up of the
async push, the paper's numbers, and the efficiency against the free-push bound, as one section of
fig11b.md (`fig11b_relay.py` adds star vs relay at 8 and 32 generators beside it).

    .venv/bin/python benchmarks/paper/fig11b_weight_sync.py            # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from simrun import PAPER_NODES, ROOT, paper_run_spec, run, save_plot, tiny_tokenizer_model, write_section

from rollart.sim.hardware import MODELS, transfer_s

TITLE = "Fig. 11b: asynchronous vs synchronous cross-cluster weight sync (simulation)"
HEADING = "Async vs sync push, the paper's 12 engines, a copy each (star)"
"""This experiment's section of fig11b.md (`fig11b_relay.py` writes another)."""
LINK_GBPS = 200.0
PUSHES = {
    "sync push (NCCL-like)": {"push": "sync"},
    "async push (Mooncake-like)": {"push": "async"},
    "bound: push costs nothing": {"push": "async", "link_gbps": 1e9, "host_load_gbs": 1e9},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "paper" / "fig11b.md")
    args = parser.parse_args()
    model = tiny_tokenizer_model()
    began = time.monotonic()
    measured = {}
    for name, push in PUSHES.items():
        print(f"{name} ...", flush=True)
        spec = paper_run_spec(model, speedup=1, steps=args.steps, schedule="async", alpha=1)
        spec["sim"]["trainer"] |= {"link_gbps": LINK_GBPS} | push
        measured[name] = result = run(spec, PAPER_NODES, inprocess=True)
        print(f"  step times (simulated s): {[round(s) for s in result.step_s]}", flush=True)
    sync, asynchronous = measured["sync push (NCCL-like)"], measured["async push (Mooncake-like)"]
    bound = measured["bound: push costs nothing"].mean_step_s
    lines = ["| weight push | step s | speed-up vs sync push | paper |", "|---|---:|---:|---|"]
    for name, result in measured.items():
        paper = "1.10-1.16x" if result is asynchronous else "-"
        lines.append(f"| {name} | {result.mean_step_s:.0f} | {sync.mean_step_s / result.mean_step_s:.2f}x | {paper} |")
    cross = transfer_s(MODELS["qwen3-32b"], gbps=LINK_GBPS) * 12
    summary = (
        f"async push {sync.mean_step_s / asynchronous.mean_step_s:.2f}x over sync (paper 1.10-1.16x); one push "
        f"moves 12 copies of 65.6 GB over {LINK_GBPS:g} Gb/s in {cross:.0f} s (paper, 32B: 38.6-157 s unhidden); "
        f"efficiency against the free-push bound {bound / asynchronous.mean_step_s:.2f}"
    )
    table = "\n".join(lines) + "\n\n" + summary
    print(table)
    shape = (
        "`benchmarks/paper/simrun.py` `paper_run_spec` (Qwen3-32B, batch 64 x 8, game + math, 64 H800 + 32 H20, "
        f"a simulated 32-H800 trainer, alpha 1), a {LINK_GBPS:g} Gb/s link, one copy per engine; in-process, "
        f"virtual clock; {args.steps} batches per run"
    )
    write_section(args.out, TITLE, HEADING, began=began, shape=shape, body=table)
    speedups = {name: sync.mean_step_s / result.mean_step_s for name, result in measured.items()}
    save_plot(args.out, TITLE, "speed-up over the sync push", speedups, {"async push (Mooncake-like)": 1.10})


if __name__ == "__main__":
    main()
