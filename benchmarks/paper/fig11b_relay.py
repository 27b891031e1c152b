"""Fig. 11b, extended: the weight push as a star or a relay, at 8 and 32 generators, sync and async.

The paper's workload (`simrun.paper_run_spec`: Qwen3-32B, batch 512, game + math, a simulated
32-H800 trainer, RollArt alpha 1) on the same 64 generation GPUs, 32 H800 and 32 H20, cut into N
engines (generators): N/2 of each kind, 64/N GPUs each (8: TP 8, one per host; 32: TP 2, four per
host). The generators sit in another cluster than the trainer, across its 200 Gb/s Ethernet egress.
Each is pushed the weights (bf16, 2 bytes a parameter) after every step, by one of two plans
(`rollart/sim/weight_sync.py`):

- **star**: the trainer sends every generator its own copy at once, N copies through its link;
- **relay**: the trainer sends each 64 MiB bucket once; generators forward it down a chain planned
  by host (400 Gb/s InfiniBand between hosts, NVLink inside one) as soon as it is in;

and either **sync** (the trainer waits, engines stop until their copy is in) or **async** (the
trainer goes on; engines stop only to load from host memory; the trainer sends the newest version
whenever its link is free). A push that costs nothing is the bound.

Reports, per run: when the last generator holds a version, the trainer's egress over the state
dict's size, step time, how many versions behind the batch the weights that generated its tokens
were, and how many versions an async push skipped because the trainer's link was still busy with
the one before (a push that falls behind shows there, not in step time); the paper's numbers beside.

    .venv/bin/python benchmarks/paper/fig11b_relay.py                 # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/paper/fig11b_relay.py --generators 8  # one size
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from fig11b_weight_sync import TITLE
from simrun import PAPER_NODES, ROOT, Result, paper_run_spec, run, save_plot, tiny_tokenizer_model, write_section

from rollart.sim.config import SimTrainerSpec
from rollart.sim.hardware import MODELS, EngineShape
from rollart.sim.weight_sync import Links, engine_places, sync_times

GPUS = {"compute": "H800", "bandwidth": "H20"}
"""32 of each kind."""
PAPER = "async over sync 1.10-1.16x (plan not given)"
"""PAPER.md: 'asynchronous cross-cluster weight sync ... 1.10-1.16x step time'; nothing on star vs
relay or on the number of generators (the paper's system pushes through the Mooncake store)."""
RUNS: dict[str, dict[str, Any]] = {
    "star, sync": {"plan": "star", "push": "sync"},
    "relay, sync": {"plan": "relay", "push": "sync"},
    "star, async": {"plan": "star", "push": "async"},
    "relay, async": {"plan": "relay", "push": "async"},
    "bound: push costs nothing": {"push": "async", "link_gbps": 1e9, "host_load_gbs": 1e9},
}


def engines(n: int) -> dict[str, dict[str, Any]]:
    """64 GPUs as `n` engines: n/2 of each kind, 64/n GPUs each."""
    if n % 2 or 64 % n:
        raise SystemExit(f"--generators: 64 GPUs split evenly into two kinds; {n} does not divide them")
    return {kind: {"gpu": gpu, "gpus": 64 // n, "replicas": n // 2} for kind, gpu in GPUS.items()}


def token_lag(result: Result) -> float:
    """Mean, over generated tokens, of how many versions the weights that generated each were behind
    the version its batch was taken at."""
    lags = [
        taken - version
        for t, taken in zip(result.trajectories, result.versions, strict=True)
        for version in t["versions"]
        if version >= 0
    ]
    return statistics.fmean(lags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--generators", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "paper" / "fig11b.md")
    args = parser.parse_args()
    model, weights = tiny_tokenizer_model(), MODELS["qwen3-32b"]
    trainer = SimTrainerSpec()  # the defaults: 200 Gb/s egress, 400 Gb/s between hosts, 64 MiB buckets
    links = Links(cross_gbps=trainer.link_gbps, cluster_gbps=trainer.cluster_gbps, host_gbps=trainer.host_gbps)
    began = time.monotonic()
    lines = [
        "| generators | plan, push | last generator holds it, s | trainer egress / state | step s "
        "| vs star, sync | token lag (versions) | versions skipped | paper |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    notes, speedups = [], {}
    for n in args.generators:
        shapes = engines(n)
        places = [place for _, place in engine_places({k: EngineShape(**v) for k, v in shapes.items()})]
        measured = {}
        for name, push in RUNS.items():
            print(f"{n} generators, {name} ...", flush=True)
            spec = paper_run_spec(model, speedup=1, steps=args.steps, schedule="async", alpha=1, engines=shapes)
            spec["sim"]["trainer"] |= push
            measured[name] = result = run(spec, PAPER_NODES, inprocess=True)
            print(f"  step times (simulated s): {[round(s) for s in result.step_s]}", flush=True)
        base = measured["star, sync"].mean_step_s
        for name, result in measured.items():
            push = RUNS[name]
            if "plan" in push:
                sync = sync_times(
                    weights.weight_bytes, places, push["plan"], bucket_bytes=trainer.bucket_mb << 20, links=links
                )
                held, egress = f"{sync.last_s:.1f}", f"{sync.egress_copies:.0f}"
            else:
                held, egress = "0", "-"
            paper = PAPER if push.get("push") == "async" and "plan" in push else "-"
            pushed = result.weights_pushed or []
            skipped = sum(1 for v in range(1, max(pushed, default=0)) if v not in pushed)
            lines.append(
                f"| {n} | {name} | {held} | {egress} | {result.mean_step_s:.0f} | {base / result.mean_step_s:.2f}x "
                f"| {token_lag(result):.2f} | {skipped} | {paper} |"
            )
            speedups[f"{n}: {name}"] = base / result.mean_step_s
        star = measured["star, sync"].mean_step_s / measured["star, async"].mean_step_s
        relay = measured["relay, sync"].mean_step_s / measured["relay, async"].mean_step_s
        bound = measured["bound: push costs nothing"].mean_step_s
        notes.append(
            f"{n} generators: async over sync {star:.2f}x for the star, {relay:.2f}x for the relay (paper "
            f"1.10-1.16x); relay async at {bound / measured['relay, async'].mean_step_s:.2f} of the free-push "
            f"bound, star async at {bound / measured['star, async'].mean_step_s:.2f}"
        )
    table = "\n".join(lines) + "\n\n" + "\n\n".join(notes)
    print(table)
    shape = (
        "`benchmarks/paper/simrun.py` `paper_run_spec` (Qwen3-32B, batch 64 x 8, game + math, a simulated "
        "32-H800 trainer, alpha 1) on 32 H800 + 32 H20 as N engines (N/2 of each, 64/N GPUs each); "
        f"Qwen3-32B's {weights.params_b:g}B parameters in bf16 on the wire ({weights.weight_bytes / 1e9:.1f} GB) "
        f"in {trainer.bucket_mb} MiB buckets; trainer egress {trainer.link_gbps:g} Gb/s (the paper's cross-cluster "
        f"Ethernet), {trainer.cluster_gbps:g} Gb/s between generator hosts (the paper's InfiniBand), "
        f"{trainer.host_gbps:g} Gb/s inside a host (H800 NVLink, data sheet); relay = chain; in-process, "
        f"virtual clock; {args.steps} batches per run"
    )
    heading = f"Star vs relay at {' and '.join(map(str, args.generators))} generators"
    write_section(args.out, TITLE, heading, began=began, shape=shape, body=table)
    save_plot(args.out.with_name("fig11b-relay.md"), heading, "speed-up over star, sync", speedups)


if __name__ == "__main__":
    main()
