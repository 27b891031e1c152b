"""Profile one training step of the default run's shape: where the trainer's time goes, op by op.

    .venv/bin/python benchmarks/profile_step.py [--steps 3] [--out benchmarks/results/profile_step.md]

Builds a batch like the default run's (`configs/local.yaml`: 12 groups of 8 episodes of its two
tasks, in proportion to their weights, each episode played by the random valid policy and
rendered as the generators would), takes a warm-up step, then `--steps` steps with the topology's
trainer settings, each under `torch.profiler`. Writes the step's own split (`time_*_s`), the
profiler's table of the ops that took the most CPU time, and, for comparison, what one no-grad
forward over the batch costs (the pass a step with several passes over one mini-batch used to
recompute for pi_prox, and no longer does), and the step's time at other micro-batch sizes, with
the rows that read the same prefix sharing one pass through the decoder (`share_reads`, the
default) and without. Ends with `summary: share_reads_speedup=X.XX` (a step without shared reads
over one with them, at the topology's micro-batch size).
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script

from rollart.algorithms.grpo import PackedBatch, pack_batch
from rollart.models.loading import load_model_and_tokenizer
from rollart.rollout.render import ChatRenderer
from rollart.tiny.warmup import random_episode
from rollart.topology import load_topology
from rollart.training.registry import build_training_engine
from rollart.training.step import read_groups

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "profile_step.md"


class Episode:
    """A random episode as `pack_batch` reads it: each turn's prompt a segment of its own."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], rng: random.Random) -> None:
        first_ids, first_mask = rows[0]
        cut = first_mask.index(1) if 1 in first_mask else len(first_ids) - 1
        self.prompt_ids = first_ids[:cut]
        self.response_ids = first_ids[cut:]
        self.response_mask = first_mask[cut:]
        self.segments: list[int] = []
        for ids, mask in rows[1:]:
            self.segments.append(len(self.response_ids))
            self.response_ids += ids
            self.response_mask += mask
        self.logprobs = [-rng.uniform(0.1, 3.0) for _ in self.response_ids]
        self.versions = [0] * len(self.response_ids)


def default_batch(topology_path: Path, seed: int) -> tuple[PackedBatch, Path]:
    topology = load_topology(topology_path)
    run = topology.run
    assert run.rollout is not None
    _, tokenizer = load_model_and_tokenizer(run.model.path)
    renderer = ChatRenderer(tokenizer)  # type: ignore[arg-type]
    rng = random.Random(seed)
    tasks = run.rollout.tasks
    groups = rng.choices(tasks, weights=[t.weight for t in tasks], k=run.rollout.batch_groups)
    episodes = [Episode(random_episode(task, renderer, rng), rng) for task in groups for _ in range(8)]
    advantages = [rng.choice((-1.0, 1.0)) for _ in episodes]
    return pack_batch(episodes, advantages, pad_id=tokenizer.pad_token_id), Path(run.model.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--micro-batch-sizes",
        default="16,64,256,1024",
        help="also time steps (unprofiled) at these micro-batch sizes, with shared reads and without; empty: skip",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    machine = describe(["torch", "transformers"])  # the load average before this run adds to it
    topology = load_topology(args.topology)
    spec = topology.run.trainer
    batch, model_path = default_batch(args.topology, seed=0)
    if not model_path.is_dir():
        sys.exit(f"{model_path}: no model; run `bin/rollart run {args.topology}` once to build it")
    groups, lengths = read_groups(batch, share=True)
    reads, read_tokens, batch_tokens = len(groups), sum(lengths), int(batch.attention_mask.sum())
    engine = build_training_engine(spec, model_path, seed=0)
    engine.train_step(batch, version=1)  # warm-up: allocations, the optimizer's state
    steps, tables = [], []
    for _ in range(args.steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            steps.append(engine.train_step(batch, version=1))
        tables.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    model = engine.model  # type: ignore[attr-defined]
    runner = engine.runner  # type: ignore[attr-defined]
    forward_s = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            for mb in batch.micro_batches(spec.micro_batch_size):
                runner.logprobs(model, mb)
        forward_s.append(time.perf_counter() - t0)

    by_size = []
    for size in [int(n) for n in args.micro_batch_sizes.split(",") if n]:
        seconds = []
        for share in (True, False):
            other = build_training_engine(
                msgspec.structs.replace(spec, micro_batch_size=size, share_reads=share), model_path, seed=0
            )
            other.train_step(batch, version=1)
            seconds.append(statistics.median(other.train_step(batch, version=1)["train_s"] for _ in range(args.steps)))
            del other
        by_size.append((size, *seconds))

    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    train_s = median("train_s")
    parts = ["time_recompute_s", "time_forward_s", "time_backward_s", "time_optimizer_s"]
    lines = [
        "# One training step of the default run's shape, profiled",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- machine: {machine}",
        f"- command: `.venv/bin/python benchmarks/profile_step.py --steps {args.steps}` "
        f"(took {time.perf_counter() - started:.0f} s)",
        f"- batch: {batch.input_ids.shape[0]} rows x {batch.input_ids.shape[1]} positions, "
        f"{batch.loss_tokens} loss tokens ({topology.run.rollout.batch_groups} groups of 8 random episodes"  # type: ignore[union-attr]
        f" of {args.topology.name}'s tasks); trainer: epochs {spec.epochs}, micro-batches of "
        f"{spec.micro_batch_size} rows, {spec.threads or torch.get_num_threads()} intra-op threads",
        "",
        "| part | seconds (median of the steps) | share of the step |",
        "|---|---:|---:|",
        *(f"| {key} | {median(key):.3f} | {median(key) / train_s:.2f} |" for key in parts),
        f"| whole step (`train_s`) | {train_s:.3f} | 1.00 |",
        f"| one no-grad forward over the batch (what pi_prox used to cost) | "
        f"{statistics.median(forward_s):.3f} | {statistics.median(forward_s) / train_s:.2f} |",
        "",
        *(
            ["## Step time by micro-batch size, shared reads on and off (median of the steps, unprofiled)", ""]
            if by_size
            else []
        ),
        *(
            [
                f"With `share_reads` (the default) the batch's {reads} distinct prefixes go through the decoder, "
                f"{read_tokens} tokens in all, instead of its {len(batch)} rows' {batch_tokens} tokens; "
                "a micro-batch's size then counts prefixes.",
                "",
                "| micro-batch size | train_s, shared reads | train_s, every row | every row / shared |",
                "|---:|---:|---:|---:|",
                *(f"| {size} | {on:.3f} | {off:.3f} | {off / on:.2f} |" for size, on, off in by_size),
                "",
            ]
            if by_size
            else []
        ),
        "## The ops that took the most CPU time (the last profiled step)",
        "",
        "```",
        tables[-1],
        "```",
    ]
    if by_size:
        at_spec = next(((on, off) for size, on, off in by_size if size == spec.micro_batch_size), by_size[0][1:])
        lines += ["", f"summary: share_reads_speedup={at_spec[1] / at_spec[0]:.2f}"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
