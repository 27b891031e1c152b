"""Fig. 14: reward on dedicated local GPUs vs Reward-as-a-Service.

The paper's setup (its section 7.3, R3): 16 H800 per job, 8 training a Qwen3-8B actor on a math
task (16K context, batch 84), a Qwen2.5-7B reward LLM judging every trajectory.

- **local GPU**: 4 H800 generate (4 engines of 1 GPU), 4 H800 are reserved for the reward model
  (one judge per GPU, requests queue when all four are busy);
- **reward service**: all 8 H800 generate; the judge runs on an elastic service that starts a
  worker per waiting request (a cold start first), up to 16, and releases one idle for 30 s.

Simulation (`rollart/sim/reward.py`: a judge's time is the prefill of the trajectory plus a short
verdict on one GPU, by the same cost model as the engines), in-process on a virtual clock,
synchronous schedule (the batch is rolled out, then trained on): rollout time per step is the
step minus the modelled training step and weight push. Reports rollout time, reward GPU
utilization (busy / live worker-seconds), and the bound: the rollout time on the same 8 GPUs with
a reward that costs nothing.

With `--jobs 2,4,8`, a second table: that many such runs at once (each 8 H800 generating, its own
seed) sharing ONE reward service of up to `--service-workers` judges, fairly by job
(`rollart/rewards/fair.py`), all in one process on one virtual clock (`run_inprocess_jobs`): the
service's reward GPU utilization next to the paper's 88%, and each run's rollout time next to
running alone.

    .venv/bin/python benchmarks/paper/fig14_reward_service.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/paper/fig14_reward_service.py --jobs 2,4,8
    .venv/bin/python benchmarks/paper/fig14_reward_service.py --jobs 1,2,4,8 --service-release by-gap \
        --shared-schedule async --out benchmarks/results/paper/fig14-shared-async.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from simrun import (
    ROOT,
    Result,
    inprocess_result,
    inprocess_topology,
    run,
    save_plot,
    tiny_tokenizer_model,
    write_report,
)

from rollart.sim.hardware import GPUS, MODELS, train_step_s, transfer_s

NODES = [
    {"name": "trainer", "role": "trainer"},
    {"name": "gen", "role": "generator", "hardware": "compute"},
    {"name": "env-0", "role": "env-host"},
    {"name": "reward", "role": "reward-gateway"},
]
TRAIN_GPUS, LINK_GBPS = 8, 400.0
SETUPS: dict[str, tuple[int, dict[str, Any]]] = {
    "local GPU (4 generate + 4 reward)": (4, {"placement": "local", "workers": 4}),
    "reward service (8 generate)": (
        8,
        {"placement": "service", "workers": 16, "cold_start_s": 15.0, "idle_timeout_s": 30.0},
    ),
    "bound: 8 generate, reward free": (8, {"placement": "instant"}),
}
PAPER = {"local GPU (4 generate + 4 reward)": ("158 s", "6%"), "reward service (8 generate)": ("77 s", "88%")}


SERVICE = {"placement": "service", "cold_start_s": 15.0, "idle_timeout_s": 30.0}
SERVICE_PORT = 30000


def run_spec(
    model: Path, args: argparse.Namespace, generators: int, reward: dict[str, Any], seed: int = 0
) -> dict[str, Any]:
    return {
        "restart": {"policy": "stop-all"},
        "model": {"path": str(model)},
        "generator": {"backend": "sim", "max_num_seqs": 256},
        "sim": {
            "model": "qwen3-8b",
            "engines": {"compute": {"gpu": "H800", "gpus": 1, "replicas": generators}},
            "response_length_min_frac": 0.25,
            "max_steps_per_wake": 32,
            "trainer": {"gpu": "H800", "gpus": TRAIN_GPUS, "mfu": 0.4, "link_gbps": LINK_GBPS},
            "reward": {"model": "qwen2.5-7b", "gpu": "H800"} | reward,
        },
        "rollout": {
            "mode": "rollout-only",
            "schedule": "sync",
            "seed": seed,
            "tasks": [
                {
                    "name": "math",
                    "env": "sim",
                    "env_kwargs": {"turns": 1, "obs_tokens": 400, "reset_s": 1.0, "sigma": 1.0},
                    "profile": "decode-heavy",
                    "reward": "env-reward",
                    "max_tokens_per_turn": 16000,
                    "max_total_tokens": 16384,
                }
            ],
            "group_size": args.group_size,
            "redundancy": 0,
            "batch_groups": args.batch_groups,
            "steps": args.steps,
            "groups_per_env_host": 2 * args.batch_groups,
            "generate_timeout_s": 3600,
            "env_timeout_s": 600,
            "reward_timeout_s": 600,
            "group_timeout_s": 7200,
        },
    }


def rollout_s(result: Result) -> float:
    """Mean rollout time per step: the gap between batches less the modelled training step and push."""
    model, gpu = MODELS["qwen3-8b"], GPUS["H800"]
    tokens: dict[int, int] = {}
    for t, version in zip(result.trajectories, result.versions, strict=True):
        tokens[version] = tokens.get(version, 0) + len(t["prompt_ids"]) + len(t["response_ids"])
    overhead = [
        train_step_s(model, gpu, gpus=TRAIN_GPUS, mfu=0.4, tokens=n) + transfer_s(model, gbps=LINK_GBPS)
        for version, n in sorted(tokens.items())[:-1]  # the batch before each measured gap
    ]
    gaps = result.step_s[-len(overhead) :] if overhead else result.step_s
    return statistics.fmean(gap - cost for gap, cost in zip(gaps, overhead, strict=False))


def run_shared(model: Path, args: argparse.Namespace, jobs: int) -> tuple[list[Result], Any]:
    """`jobs` runs of 8 generating GPUs sharing one reward service; each run's result and the service's stats."""
    from rollart.launch.inprocess import run_inprocess_jobs

    names = [f"job-{i}" for i in range(jobs)]
    with tempfile.TemporaryDirectory(prefix="rollart-fig14-") as tmp:
        folder = Path(tmp)
        topologies = []
        for i, name in enumerate(names):
            spec = run_spec(model, args, 8, {"placement": "instant"}, seed=i)
            if args.shared_schedule == "async":  # RollArt's own: rewards asked for as trajectories finish
                spec["rollout"] |= {"schedule": "async", "alpha": 1}
            spec["reward_service"] = {"port": SERVICE_PORT}
            nodes = [node for node in NODES if node["role"] != "reward-gateway"]
            topologies.append(inprocess_topology(spec, nodes, folder, name=name, first_port=20000 + 100 * i))
        judges = {
            "workers": args.service_workers,
            "idle_timeout_s": args.service_idle_s,
            "release": args.service_release,
            "warm_start_s": args.service_warm_s,
        }
        service_spec = run_spec(model, args, 8, SERVICE | judges)
        del service_spec["rollout"]
        service_spec["reward_pool"] = {"jobs": [{"name": name, "secret_env": "UNUSED_IN_PROCESS"} for name in names]}
        gateway = [{"name": "reward", "role": "reward-gateway"}]
        service = inprocess_topology(service_spec, gateway, folder, name="reward-service", first_port=SERVICE_PORT)
        done, stats = run_inprocess_jobs(topologies, service, log=folder / "nodes.log")
    return [inprocess_result(one) for one in done], stats


def shared_table(model: Path, args: argparse.Namespace, alone_s: float) -> tuple[str, float]:
    """The N-jobs table, and the service's utilization at the largest N."""
    lines = [
        "| runs sharing the service | reward GPU utilization | peak judges | rollout s per step, mean of runs "
        "| slowest / fastest run | vs the service run above (sync, alone) | paper utilization |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    util = 0.0
    for jobs in args.jobs:
        print(f"{jobs} runs sharing one reward service ...", flush=True)
        results, stats = run_shared(model, args, jobs)
        per_run = [rollout_s(result) for result in results]
        util = stats.utilization
        shares = ", ".join(f"{name} {job.share:.2f}" for name, job in stats.jobs.items())
        print(f"  rollout s per run {[round(s) for s in per_run]}; utilization {util:.2f}; shares {shares}")
        mean = statistics.fmean(per_run)
        lines.append(
            f"| {jobs} | {util:.0%} | {stats.peak_workers} | {mean:.0f} | {max(per_run) / min(per_run):.2f} "
            f"| {mean / alone_s:.2f} | 88% |"
        )
    return "\n".join(lines), util


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-groups", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=7, help="12 x 7 = the paper's batch of 84")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "paper" / "fig14.md")
    parser.add_argument(
        "--jobs",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[],
        help="also run this many runs sharing one reward service, e.g. 2,4,8",
    )
    parser.add_argument("--service-workers", type=int, default=16, help="judges the shared service may start")
    parser.add_argument("--service-idle-s", type=float, default=30.0, help="the shared service's judges' idle timeout")
    parser.add_argument(
        "--service-warm-s",
        type=float,
        default=None,
        help="the shared service's starts once it holds the judge's weights in host memory (run.sim.reward."
        "warm_start_s; default: every start cold, 15 s)",
    )
    parser.add_argument(
        "--service-release",
        choices=["idle", "by-gap"],
        default="idle",
        help="when the shared service releases an idle judge (run.sim.reward.release; idle: the paper's)",
    )
    parser.add_argument(
        "--shared-schedule",
        choices=["sync", "async"],
        default="sync",
        help="the schedule of the runs sharing the service (sync: as the single runs above; async: RollArt's)",
    )
    args = parser.parse_args()
    model = tiny_tokenizer_model()
    began = time.monotonic()
    measured = {}
    for name, (generators, reward) in SETUPS.items():
        print(f"{name} ...", flush=True)
        measured[name] = result = run(run_spec(model, args, generators, reward), NODES, inprocess=True)
        print(f"  steps (simulated s): {[round(s) for s in result.step_s]}; reward util {result.reward_utilization}")
    local = measured["local GPU (4 generate + 4 reward)"]
    service = measured["reward service (8 generate)"]
    bound = rollout_s(measured["bound: 8 generate, reward free"])
    lines = [
        "| placement | rollout s per step | reward GPU utilization | paper rollout s | paper utilization |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, result in measured.items():
        util = f"{result.reward_utilization:.0%}" if result.reward_utilization is not None else "-"
        paper_s, paper_util = PAPER.get(name, ("-", "-"))
        lines.append(f"| {name} | {rollout_s(result):.0f} | {util} | {paper_s} | {paper_util} |")
    ratio = rollout_s(service) / rollout_s(local)
    summary = (
        f"rollout with the reward service is {ratio:.2f} of the local-GPU time (target <= 0.5: "
        f"{'met' if ratio <= 0.5 else 'missed'}; paper 77 / 158 = 0.49); efficiency against the free-reward "
        f"bound {bound / rollout_s(service):.2f}"
    )
    table = "\n".join(lines) + "\n\n" + summary
    if args.jobs:
        shared, util = shared_table(model, args, rollout_s(service))
        released = f"after {args.service_idle_s:g} s idle"
        if args.service_release == "by-gap":
            released = (
                "once their next request is predicted further off than a cold start or the load does not need "
                f"them, at most {released}"
            )
        if args.service_warm_s is not None:
            released += (
                f"; after the first cold start (15 s) every start is warm, {args.service_warm_s:g} s, the judge's "
                "weights loaded from the service's host memory"
            )
        table += (
            f"\n\n### One reward service shared by several runs ({args.shared_schedule} schedule; up to "
            f"{args.service_workers} judges, released {released})\n\n{shared}\n\n"
            f"reward_util_shared={util:.2f} (the service's busy / live judge-seconds with {args.jobs[-1]} runs; "
            "paper 88%)"
        )
    print(table)
    shape = (
        f"simulated Qwen3-8B actor, 1-GPU H800 engines; a math task, one turn, 400 prompt tokens, answers "
        f"of 4-16K tokens; batch {args.batch_groups} x {args.group_size}; Qwen2.5-7B judge writing 16 tokens; "
        f"{TRAIN_GPUS} H800 training (mfu 0.4), weights pushed over {LINK_GBPS:g} Gb/s; sync schedule; "
        f"in-process, virtual clock; {args.steps} batches per run"
    )
    title = "Fig. 14: reward on local GPUs vs Reward-as-a-Service (simulation)"
    write_report(args.out, title, began=began, shape=shape, body=table)
    rollout = {name: rollout_s(result) for name, result in measured.items()}
    paper_s = {"local GPU (4 generate + 4 reward)": 158.0, "reward service (8 generate)": 77.0}
    save_plot(args.out, title, "rollout s per step (simulated)", rollout, paper_s)


if __name__ == "__main__":
    main()
