"""Fig. 12a: trajectory-level rollout vs batch-level env handling, at env latency spread sigma 1 and 10.

Simulation mode (docs/simulation.md), real node processes: one trainer, one generator (a
simulated Qwen3-8B on 8 x H800), two env-hosts, a reward gateway. One multi-turn task whose every
env reset and step takes `median * exp(sigma * N(0, 1))` simulated seconds (capped), as in the paper's
latency-spread experiment. Two modes, the same code and config otherwise:

- **batch-level** (`schedule: sync`): the veRL-like baseline: each env-host steps its groups as a
  batch whose every turn waits for all of them, and a batch starts when the last one is taken;
- **trajectory-level** (`schedule: async`, alpha 1, or `--alpha`): RollArt: every trajectory is its
  own coroutine, and the next batch's trajectories run while the last ones of this batch finish;
- with `--min-group-size K`, a third: trajectory-level where a group past its deadline (the
  `--deadline-quantile` of its task's trajectory times, learned on each env-host) is done with the
  K or more it has (`rollout.min_group_size`; a different batch: groups of fewer than G, biased
  toward quick episodes, `rollart.rollout.group`).

Reports the mean step time (simulated seconds between batches), the speed-up, the paper's figure
beside it, two bounds and an efficiency. The no-barrier step: what a synchronous step would take
without the per-turn barrier (per batch, its slowest trajectory's own env latency plus
generation). The throughput bound for trajectory-level rollout: with C groups in flight at once and
groups that take T on average on their own (their slowest trajectory's env latency plus
generation), a batch of B groups cannot come faster than B * T / C (Little's law); C is what
admission allows, (alpha + 1) * B, or the env-hosts' slots (2 x `groups_per_env_host` = 2B) where
those are fewer; efficiency = ideal / measured. Beside it, the staleness that bought it: how many
versions, on average, a trained trajectory's first turn was behind the batch that took it.

    .venv/bin/python benchmarks/paper/fig12a_env_handling.py            # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/paper/fig12a_env_handling.py --quick    # sigma 1, fewer steps
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from simrun import (
    ROOT,
    Result,
    add_mode_arguments,
    mode_words,
    resolve_mode,
    run,
    save_plot,
    tiny_tokenizer_model,
    write_report,
)

PAPER = {1.0: 1.23, 10.0: 2.27}
TARGET = {1.0: 1.3, 10.0: 2.5}
COMPARED = ("batch-level", "trajectory-level")
"""The two modes every run compares; `modes` adds the others asked for."""


def run_spec(args: argparse.Namespace, sigma: float, mode: str, model: Path) -> dict[str, Any]:
    env_kwargs = {
        "turns": args.turns,
        "obs_tokens": 300,
        "reset_s": args.reset_s,
        "step_s": args.step_s,
        "sigma": sigma,
        "cap_s": args.cap_s,
    }
    return {
        "restart": {"policy": "stop-all"},
        "model": {"path": str(model)},
        "generator": {"backend": "sim", "max_num_seqs": 512},
        "reward_pool": {"min_workers": 1, "max_workers": 2},
        "sim": {
            "speedup": args.speedup,
            "model": "qwen3-8b",
            "engines": {"compute": {"gpu": "H800", "gpus": 8}},
            "max_steps_per_wake": 16,
            "reward": {"placement": "instant"},
        },
        "rollout": {
            "mode": "rollout-only",
            "tasks": [
                {
                    "name": "game",
                    "env": "sim",
                    "env_kwargs": env_kwargs,
                    "profile": "prefill-heavy",
                    "max_tokens_per_turn": 32,
                    "max_total_tokens": 8192,
                }
            ],
            "group_size": args.group_size,
            "redundancy": 0,
            "batch_groups": args.batch_groups,
            "steps": args.steps,
            "groups_per_env_host": args.batch_groups,
            "generate_timeout_s": 600,
            "env_timeout_s": 600,
            "group_timeout_s": 3600,
        }
        | modes(args)[mode],
    }


def modes(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The modes run, by name: the rollout fields each sets."""
    base = {"batch-level": {"schedule": "sync"}, "trajectory-level": {"schedule": "async", "alpha": args.alpha}}
    more = {}
    cut = {"min_group_size": args.min_group_size, "deadline_quantile": args.deadline_quantile}
    if args.min_group_size is not None:
        more["deadline"] = base["trajectory-level"] | cut
    if args.max_redundancy is not None:
        adaptive = base["trajectory-level"] | {"max_redundancy": args.max_redundancy}
        more["adaptive extras"] = adaptive
        if args.min_group_size is not None:
            more["deadline + adaptive extras"] = adaptive | cut
    return base | more


NODES = [
    {"name": "trainer", "role": "trainer"},
    {"name": "gen-0", "role": "generator", "hardware": "compute"},
    {"name": "env-0", "role": "env-host"},
    {"name": "env-1", "role": "env-host"},
    {"name": "reward", "role": "reward-gateway"},
]


def no_barrier_step_s(result: Result, speedup: float) -> float:
    """What a synchronous step would take without the per-turn barrier: per batch, the slowest
    trajectory's own time (env latency plus generation); the mean over batches."""
    slowest: dict[int, float] = {}
    for t, version in zip(result.trajectories, result.versions, strict=True):
        slowest[version] = max(slowest.get(version, 0.0), (t["env_wait_s"] + t["gen_wait_s"]) * speedup)
    return statistics.fmean(slowest.values())


def staleness(result: Result) -> float:
    """Mean versions a trained trajectory's first turn was behind the batch that took it."""
    return statistics.fmean(
        version - t["started_at_version"] for t, version in zip(result.trajectories, result.versions, strict=True)
    )


def ideal_step_s(result: Result, args: argparse.Namespace, speedup: float) -> float:
    """B * T / C over groups: a group holds its env-host slot until its slowest trajectory ends, so T
    is the mean over groups of their slowest member's own time (env latency plus generation), C the
    groups in flight (what admission allows at alpha, or the env-hosts' slots where fewer), B the groups
    per batch."""
    groups: dict[str, float] = {}
    for t in result.trajectories:
        alone = (t["env_wait_s"] + t["gen_wait_s"]) * speedup
        groups[t["group_id"]] = max(groups.get(t["group_id"], 0.0), alone)
    slots = args.batch_groups * sum(node["role"] == "env-host" for node in NODES)  # groups_per_env_host each
    in_flight = min((args.alpha + 1) * args.batch_groups, slots)
    return args.batch_groups * statistics.fmean(groups.values()) / in_flight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="sigma 1 only, 3 steps")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reset-s", type=float, default=5.0, help="median env reset latency, simulated s")
    parser.add_argument("--step-s", type=float, default=2.0, help="median env step latency, simulated s")
    parser.add_argument("--cap-s", type=float, default=120.0, help="longest env call, simulated s")
    parser.add_argument("--min-group-size", type=int, help="also run groups cut at their deadline to this many")
    parser.add_argument("--deadline-quantile", type=float, default=0.9, help="of trajectory times (with the above)")
    parser.add_argument("--max-redundancy", type=int, help="also run with adaptive redundancy up to this many extras")
    parser.add_argument("--alpha", type=int, default=1, help="rollout.alpha of the trajectory-level modes (default 1)")
    add_mode_arguments(parser, speedup=20.0, out=ROOT / "benchmarks" / "results" / "paper" / "fig12a.md")
    args = parser.parse_args()
    resolve_mode(args)
    sigmas = [1.0] if args.quick else [1.0, 10.0]
    if args.quick:
        args.steps = 3
    model = tiny_tokenizer_model()
    began = time.monotonic()
    rows = []
    for sigma in sigmas:
        measured = {}
        for mode in modes(args):
            print(f"sigma {sigma}: {mode} ...", flush=True)
            measured[mode] = run(run_spec(args, sigma, mode, model), NODES, inprocess=args.inprocess)
            print(f"  step times (simulated s): {[round(s) for s in measured[mode].step_s]}", flush=True)
        batch, traj = measured["batch-level"], measured["trajectory-level"]
        ideal = ideal_step_s(traj, args, traj.speedup)
        more = [measured[mode].mean_step_s for mode in modes(args) if mode not in COMPARED]
        behind = staleness(traj)
        rows.append(
            (sigma, batch.mean_step_s, traj.mean_step_s, no_barrier_step_s(batch, batch.speedup), ideal, behind, more)
        )

    names = [mode for mode in modes(args) if mode not in COMPARED]
    words = {
        "deadline": f"cut at the deadline (>= {args.min_group_size} of {args.group_size})",
        "adaptive extras": f"adaptive extras (0 to {args.max_redundancy})",
        "deadline + adaptive extras": "cut and adaptive extras",
    }
    extra = "".join(f" | {words[name]}: step s | speed-up" for name in names)
    lines = [
        "| sigma | batch-level step s | trajectory-level step s | speed-up | paper | target "
        f"| no-barrier step s | throughput bound s | efficiency (bound / trajectory-level) "
        f"| trajectory-level staleness (versions){extra} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:" + "|---:|---:" * len(names) + "|",
    ]
    for sigma, batch_s, traj_s, no_barrier, ideal, behind, more in rows:
        ratio = batch_s / traj_s
        verdict = "met" if ratio >= TARGET[sigma] else "missed"
        cells = "".join(f" | {step:.0f} | {batch_s / step:.2f}x" for step in more)
        lines.append(
            f"| {sigma:g} | {batch_s:.0f} | {traj_s:.0f} | {ratio:.2f}x | {PAPER[sigma]}x "
            f"| >= {TARGET[sigma]}x ({verdict}) | {no_barrier:.0f} | {ideal:.0f} | {ideal / traj_s:.2f} "
            f"| {behind:.2f}{cells} |"
        )
    table = "\n".join(lines)
    print(table)
    shape = (
        f"simulated Qwen3-8B on one 8 x H800 engine; batch {args.batch_groups} groups x {args.group_size}; "
        f"{args.turns} turns per episode, 300 prompt + 32 generated tokens per turn; env latency lognormal, "
        f"median reset {args.reset_s} s / step {args.step_s} s, capped at {args.cap_s} s; "
        f"{args.steps} batches per run, step time = mean gap between batches after the first; "
        f"trajectory-level at alpha {args.alpha}; "
        + (f"deadline: the {args.deadline_quantile} quantile of trajectory times; " if args.min_group_size else "")
        + mode_words(args)
    )
    title = "Fig. 12a: trajectory-level vs batch-level env handling (simulation)"
    write_report(args.out, title, began=began, shape=shape, body=table)
    speedups = {f"sigma {sigma:g}": batch_s / traj_s for sigma, batch_s, traj_s, *_ in rows}
    paper = {f"sigma {sigma:g}": PAPER[sigma] for sigma in sigmas}
    save_plot(args.out, title, "trajectory-level speed-up over batch-level", speedups, paper)


if __name__ == "__main__":
    main()
