"""Fig. 11a: hardware-affinity routing vs one GPU kind only, at (about) equal cost.

The paper's shape (`simrun.paper_run_spec`: Qwen3-32B, batch 512 = 64 groups of 8, a prefill-heavy
game and a decode-heavy math task, RollArt alpha 1, a simulated 32-H800 trainer), with the
rollout GPUs of the paper's Fig. 11a, each set costing about the same per hour (H800 2.85, H20 1.00):

- **H800 only**: 72 H800 (9 engines of 8);
- **H20 only**: 208 H20 (26 engines of 8);
- **affinity**: H800 and H20 together, the LLMProxy sending prefill-heavy turns to the H800s and
  decode-heavy ones to the H20s (with one kind only, every turn goes to it): the paper's mix,
  64 H800 + 24 H20 (8 + 3 engines), and mixes with more H20, which suit this shape's
  decode-heavy half (math answers of 2-8K tokens) better: 48 + 72, 40 + 88 and 32 + 112, and, for
  disaggregated prefill with a prefix cache (where a few H800 engines prefill for many H20 ones),
  24 + 136 and 16 + 160.

`--routing` runs the mixes under another `rollout.routing`: `finish-time`, or `disaggregated` (each turn
prefilled on the H800s and decoded on the H20s, its KV cache handed over). `--prefix-cache` models vLLM's
prefix cache in the engines (`run.sim.prefix_cache`), which the paper's vLLM had.
Every report ends with a table of what each configuration's engines did (prefill and decode tokens,
replica-seconds, cost per token).

In-process on a virtual clock (`rollart.launch.inprocess`): the real nodes and scheduling code, no
host speed in the numbers. Reports step time, the speed-up of affinity routing over each single
kind, the paper's numbers, and the bound: a step cannot be shorter than the training step.

    .venv/bin/python benchmarks/paper/fig11a_affinity.py            # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from simrun import (
    GAME_ANSWER_TOKENS,
    GAME_MAX_TOKENS,
    GAME_OBS_TOKENS,
    ROOT,
    Result,
    paper_run_spec,
    run,
    save_plot,
    tiny_tokenizer_model,
    train_step_s,
    write_report,
)

from rollart.sim.hardware import GPUS

PAPER_MIX = (64, 24)
GPU_SETS = ((72, 0), (0, 208), PAPER_MIX, (48, 72), (40, 88), (32, 112), (24, 136), (16, 160))
"""(H800, H20) GPUs of each configuration: the single kinds, the paper's mix, then mixes with more H20."""


def configs(
    gpus_per_engine: int = 8, gpu_sets: tuple[tuple[int, int], ...] = GPU_SETS
) -> dict[str, dict[str, dict[str, object]]]:
    """Each configuration's engines of `gpus_per_engine` GPUs: H800 ones as the compute class, H20 ones as the
    bandwidth class."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    for h800, h20 in gpu_sets:
        if (h800, h20) not in GPU_SETS:
            name = f"probe ({h800} H800 + {h20} H20)"
        elif not h20 or not h800:
            name = f"H800 only ({h800})" if h800 else f"H20 only ({h20})"
        else:
            paper = ", the paper's mix" if (h800, h20) == PAPER_MIX else ""
            name = f"affinity{paper} ({h800} H800 + {h20} H20)"
        engines = {"compute": ("H800", h800), "bandwidth": ("H20", h20)}
        out[name] = {
            kind: {"gpu": gpu, "gpus": gpus_per_engine, "replicas": gpus // gpus_per_engine}
            for kind, (gpu, gpus) in engines.items()
            if gpus
        }
    return out


CONFIGS = configs()
SINGLE = ("H800 only (72)", "H20 only (208)")
PAPER = {"H800 only (72)": "1.12-1.37x", "H20 only (208)": "1.30-1.68x"}
TARGET = 1.3
"""Affinity over the better single kind, from the issue."""
BATCH_GROUPS = 64
"""Groups of 8 per batch: the paper's 512 trajectories."""


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


def work_table(measured: dict[str, Result]) -> str:
    """What each configuration's engines did over its whole run (start-up and the work cut off at the end
    included): the cost of a token is one replica's hourly cost times the replica-seconds it took, so a
    decode that runs small, bandwidth-bound batches costs more per token than one that fills its batches."""
    lines = [
        "What the engines did (whole run; cost per token = a replica's cost per hour x replica-seconds per token, "
        "in millionths):",
        "",
        "| rollout GPUs | generator | prefill tokens | prefix-cached tokens | prefill replica-s | cost / prefill token "
        "| decode tokens | decode replica-s | cost / decode token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in measured.items():
        lines += work_rows(name, result)
    return "\n".join(lines)


def work_rows(name: str, result: Result) -> list[str]:
    """`work_table`'s rows of one configuration: one per generator."""
    rows = []
    for gen, work in (result.engine_work or {}).items():
        prefill, decode = (_millionths(cost) for cost in work.cost_per_token())
        rows.append(
            f"| {name} | {gen} | {work.prefill_tokens:,} | {work.cached_tokens:,} | {work.prefill_s:.0f} | {prefill} "
            f"| {work.decode_tokens:,} | {work.decode_s:.0f} | {decode} |"
        )
    return rows


def _millionths(cost: float) -> str:
    return "-" if math.isnan(cost) else f"{cost * 1e6:.0f}"


def default_out(args: argparse.Namespace) -> Path:
    """benchmarks/results/paper/fig11a[-rollout][-ROUTING][-prefix-cache][-alphaN][-batchN][-minN][-obsN][-MODEL][-tpN].md."""
    name = "fig11a-rollout" if args.rollout_only else "fig11a"
    name += f"-{args.routing}" if args.routing != "class" else ""
    name += "-prefix-cache" if args.prefix_cache else ""
    name += f"-alpha{args.alpha}" if args.alpha != 1 else ""
    name += f"-batch{8 * args.batch_groups}" if args.batch_groups != BATCH_GROUPS else ""
    name += f"-min{args.min_group_size}" if args.min_group_size is not None else ""
    name += f"-obs{args.game_obs_tokens}" if args.game_obs_tokens != GAME_OBS_TOKENS else ""
    name += f"-{args.model}" if args.model != "qwen3-32b" else ""
    name += (f"-tp{args.gpus_per_engine}" if args.gpus_per_engine != 8 else "") + ".md"
    return ROOT / "benchmarks" / "results" / "paper" / name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--rollout-only",
        action="store_true",
        help="no simulated trainer (a batch costs nothing): step time is the rollout's own throughput",
    )
    parser.add_argument("--out", type=Path, default=None, help="default fig11a.md (fig11a-rollout.md)")
    parser.add_argument(
        "--routing",
        choices=["class", "finish-time", "disaggregated"],
        default="class",
        help="rollout.routing (default: class, the paper's); another writes fig11a[-rollout]-ROUTING.md (with "
        "disaggregated, the single kinds' turns stay whole)",
    )
    parser.add_argument(
        "--alpha", type=int, default=1, help="rollout.alpha (default 1, the paper's); another adds -alphaN to the name"
    )
    parser.add_argument(
        "--prefix-cache",
        action="store_true",
        help="model vLLM's prefix cache in the simulated engines (run.sim.prefix_cache); adds -prefix-cache to the "
        "name",
    )
    parser.add_argument(
        "--batch-groups",
        type=int,
        default=BATCH_GROUPS,
        help=f"groups of 8 per batch (default {BATCH_GROUPS}, the paper's 512 trajectories); another adds -batchN",
    )
    parser.add_argument(
        "--min-group-size",
        type=int,
        default=None,
        help="rollout.min_group_size: a group past its deadline finishes with this many of its 8 (default: none, "
        "the paper's: every group waits for its slowest); adds -minN to the name",
    )
    parser.add_argument(
        "--game-obs-tokens",
        type=int,
        default=GAME_OBS_TOKENS,
        help=f"tokens of each game observation (default {GAME_OBS_TOKENS}, the paper shape's); another adds -obsN: a "
        "prefill-heavier game, as agents reading tool outputs or documents (10 turns must fit its 16,384 tokens)",
    )
    parser.add_argument(
        "--model",
        default="qwen3-32b",
        help="the simulated model (default qwen3-32b, the paper's largest); another adds -MODEL to the name (a "
        "small model is served on fewer GPUs an engine: --gpus-per-engine)",
    )
    parser.add_argument(
        "--gpus-per-engine",
        type=int,
        default=8,
        help="tensor parallel GPUs of each engine (default 8; each GPU count must divide by it); another adds -tpN",
    )
    parser.add_argument(
        "--probe",
        action="append",
        default=[],
        metavar="H800+H20",
        help="run this many H800 and H20 GPUs instead of the table's configurations, at whatever cost (as many as "
        "given; no report is written): how fast a step can get with more of either kind",
    )
    parser.add_argument(
        "--only", default="", help="run only the configurations whose name contains this (no report is written)"
    )
    args = parser.parse_args()
    try:
        args.probe = tuple((int(h800), int(h20)) for h800, h20 in (probe.split("+") for probe in args.probe))
    except ValueError:
        parser.error(f"--probe takes H800+H20 GPU counts, as 48+400; got {args.probe}")
    if any(min(probe) < 0 or not sum(probe) for probe in args.probe):
        parser.error(f"--probe needs some GPUs and none fewer than 0; got {args.probe}")
    if uneven := sorted({n for gpus in args.probe or GPU_SETS for n in gpus if n % args.gpus_per_engine}):
        parser.error(f"--gpus-per-engine {args.gpus_per_engine} does not divide the GPU counts {uneven}")
    if not 1 <= args.game_obs_tokens <= GAME_MAX_TOKENS // 10 - GAME_ANSWER_TOKENS:
        parser.error(f"--game-obs-tokens must be 1..{GAME_MAX_TOKENS // 10 - GAME_ANSWER_TOKENS}: 10 turns must fit")
    args.out = args.out or default_out(args)
    return args


def main() -> None:
    args = parse_args()
    model = tiny_tokenizer_model()
    began = time.monotonic()
    measured = {}
    chosen = configs(args.gpus_per_engine, args.probe or GPU_SETS)
    for name, engines in chosen.items():
        if args.only not in name:
            continue
        print(f"{name} ...", flush=True)
        spec = paper_run_spec(
            model,
            speedup=1,
            steps=args.steps,
            engines=engines,
            schedule="async",
            alpha=args.alpha,
            batch_groups=args.batch_groups,
            groups_per_env_host=3 * args.batch_groups // 2,  # two env-hosts: room for three batches in flight
            min_group_size=args.min_group_size,
        )
        # one GPU kind has nothing to split a turn across: its turns are whole, as with class routing
        spec["rollout"]["routing"] = "class" if args.routing == "disaggregated" and len(engines) == 1 else args.routing
        if args.rollout_only:
            spec["sim"]["trainer"] = None
        spec["sim"]["prefix_cache"] = args.prefix_cache
        spec["sim"]["model"] = args.model
        game = next(task for task in spec["rollout"]["tasks"] if task["name"] == "game")
        game["env_kwargs"]["obs_tokens"] = args.game_obs_tokens
        measured[name] = result = run(spec, nodes_for(engines), inprocess=True, keep_groups=False)
        print(f"  step times (simulated s): {[round(s) for s in result.step_s]}; busy {result.generator_busy}")
        print("\n".join(work_rows(name, result)))
    if args.only or args.probe:
        return
    better = min((measured[name] for name in SINGLE), key=lambda r: r.mean_step_s)
    lines = [
        "| rollout GPUs | cost per hour | step s | generator busy | speed-up vs the better single kind | paper |",
        "|---|---:|---:|---|---:|---|",
    ]
    for name, result in measured.items():
        engines = (result.generator_busy or {}).items()
        busy = ", ".join(f"{gen.removeprefix('gen-')} {frac:.0%}" for gen, frac in engines)
        paper = "1.12-1.37x over H800 only, 1.30-1.68x over H20 only" if "paper" in name else "-"
        lines.append(
            f"| {name} | {cost_per_hour(chosen[name]):.1f} | {result.mean_step_s:.0f} | {busy} "
            f"| {better.mean_step_s / result.mean_step_s:.2f}x | {paper} |"
        )
    mixes = {name: r for name, r in measured.items() if name not in SINGLE}
    best_name, best = min(mixes.items(), key=lambda item: item[1].mean_step_s)
    ratio = better.mean_step_s / best.mean_step_s
    bound = train_step_s(best, model=args.model)
    verdict = "met" if ratio >= TARGET else "missed"
    summary = (
        f"best mix ({best_name}) vs the better single kind: {ratio:.2f}x ({ratio:.4f} unrounded; target >= {TARGET}x: "
        f"{verdict})"
    )
    if args.rollout_only:
        summary += "; no trainer: the step is the rollout's throughput"
    else:
        summary += (
            f"; its step {best.mean_step_s:.0f} s against a training step of {bound:.0f} s "
            f"(efficiency {bound / best.mean_step_s:.2f} of the trainer-bound step)"
        )
    table = "\n".join(lines) + "\n\n" + work_table(measured) + "\n\n" + summary
    print(table)
    trainer = "no trainer (rollout only)" if args.rollout_only else "a simulated 32-H800 trainer"
    shape = (
        f"`benchmarks/paper/simrun.py` `paper_run_spec` ({args.model}, batch {args.batch_groups} x 8, game "
        f"({args.game_obs_tokens}-token observations) + math, "
        f"alpha {args.alpha}, {trainer}, routing: {args.routing}, prefix cache {'on' if args.prefix_cache else 'off'}"
        f"), rollout GPUs as in the table; in-process, virtual clock; {args.steps} batches per run, step time = mean "
        "gap between batches after the first"
    )
    title = "Fig. 11a: hardware-affinity routing at equal cost (simulation)"
    write_report(args.out, title, began=began, shape=shape, body=table)
    speedups = {name: better.mean_step_s / result.mean_step_s for name, result in measured.items()}
    paper = {"affinity, the paper's mix (64 H800 + 24 H20)": 1.12}
    save_plot(args.out, title, "speed-up over the better single kind", speedups, paper)


if __name__ == "__main__":
    main()
