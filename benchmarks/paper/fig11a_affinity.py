"""Fig. 11a: hardware-affinity routing vs one GPU kind only, at (about) equal cost.

The paper's shape (`simrun.paper_run_spec`: Qwen3-32B, batch 512 = 64 groups of 8, a prefill-heavy
game and a decode-heavy math task, RollArt alpha 1, a simulated 32-H800 trainer), with the
rollout GPUs of the paper's Fig. 11a, each set costing about the same per hour (H800 2.85, H20 1.00):

- **H800 only**: 72 H800 (9 engines of 8);
- **H20 only**: 208 H20 (26 engines of 8);
- **affinity**: 64 H800 + 24 H20 (8 + 3 engines), the LLMProxy sending prefill-heavy turns to the
  H800s and decode-heavy ones to the H20s (with one kind only, every turn goes to it).

In-process on a virtual clock (`rollart.sim.inprocess`): the real nodes and scheduling code, no
host speed in the numbers. Reports step time, the speed-up of affinity routing over each single
kind, the paper's numbers, and the bound: a step cannot be shorter than the training step.

    .venv/bin/python benchmarks/paper/fig11a_affinity.py            # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from simrun import ROOT, paper_run_spec, run, tiny_tokenizer_model, train_step_s, write_report

from rollart.sim.hardware import GPUS

CONFIGS: dict[str, dict[str, dict[str, object]]] = {
    "H800 only (72)": {"compute": {"gpu": "H800", "gpus": 8, "replicas": 9}},
    "H20 only (208)": {"bandwidth": {"gpu": "H20", "gpus": 8, "replicas": 26}},
    "affinity (64 H800 + 24 H20)": {
        "compute": {"gpu": "H800", "gpus": 8, "replicas": 8},
        "bandwidth": {"gpu": "H20", "gpus": 8, "replicas": 3},
    },
}
PAPER = {"H800 only (72)": "1.12-1.37x", "H20 only (208)": "1.30-1.68x"}
TARGET = 1.3
"""Affinity over the better single kind, from the issue."""


def nodes_for(engines: dict[str, dict[str, object]]) -> list[dict[str, object]]:
    generators = [{"name": f"gen-{kind}", "role": "generator", "hardware": kind} for kind in engines]
    return [
        {"name": "trainer", "role": "trainer"},
        *generators,
        {"name": "env-0", "role": "env-host"},
        {"name": "env-1", "role": "env-host"},
        {"name": "reward", "role": "reward-gateway"},
    ]


def cost_per_hour(engines: dict[str, dict[str, object]]) -> float:
    return sum(
        GPUS[str(e["gpu"])].cost_per_hour * int(str(e["gpus"])) * int(str(e["replicas"])) for e in engines.values()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "paper" / "fig11a.md")
    args = parser.parse_args()
    model = tiny_tokenizer_model()
    began = time.monotonic()
    measured = {}
    for name, engines in CONFIGS.items():
        print(f"{name} ...", flush=True)
        spec = paper_run_spec(model, speedup=1, steps=args.steps, engines=engines, schedule="async", alpha=1)
        measured[name] = result = run(spec, nodes_for(engines), inprocess=True)
        print(f"  step times (simulated s): {[round(s) for s in result.step_s]}; busy {result.generator_busy}")
    mix = measured["affinity (64 H800 + 24 H20)"]
    lines = [
        "| rollout GPUs | cost per hour | step s | generator busy | affinity speed-up | paper |",
        "|---|---:|---:|---|---:|---|",
    ]
    for name, result in measured.items():
        engines = (result.generator_busy or {}).items()
        busy = ", ".join(f"{gen.removeprefix('gen-')} {frac:.0%}" for gen, frac in engines)
        ratio = result.mean_step_s / mix.mean_step_s
        lines.append(
            f"| {name} | {cost_per_hour(CONFIGS[name]):.1f} | {result.mean_step_s:.0f} | {busy} "
            f"| {'-' if result is mix else f'{ratio:.2f}x'} | {PAPER.get(name, '-')} |"
        )
    better = min((r for r in measured.values() if r is not mix), key=lambda r: r.mean_step_s)
    ratio = better.mean_step_s / mix.mean_step_s
    bound = train_step_s(mix)
    summary = (
        f"affinity vs the better single kind: {ratio:.2f}x (target >= {TARGET}x: "
        f"{'met' if ratio >= TARGET else 'missed'}); affinity's step {mix.mean_step_s:.0f} s against a training "
        f"step of {bound:.0f} s (efficiency {bound / mix.mean_step_s:.2f} of the trainer-bound step)"
    )
    table = "\n".join(lines) + "\n\n" + summary
    print(table)
    shape = (
        "`benchmarks/paper/simrun.py` `paper_run_spec` (Qwen3-32B, batch 64 x 8, game + math, alpha 1, "
        f"a simulated 32-H800 trainer), rollout GPUs as in the table; in-process, virtual clock; {args.steps} "
        "batches per run, step time = mean gap between batches after the first"
    )
    title = "Fig. 11a: hardware-affinity routing at equal cost (simulation)"
    write_report(args.out, title, began=began, shape=shape, body=table)


if __name__ == "__main__":
    main()
