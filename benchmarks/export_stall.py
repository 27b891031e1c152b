"""How long a weight push holds the trainer, as a fraction of a training step: fsdp2 with 2 ranks (gloo) and the
torch backend, on the BPE test model, on CPU.

Run from the repository root (about five minutes on 2 cores; `benchmarks/weight_sync.py` runs it too):

    .venv/bin/python benchmarks/export_stall.py                  # prints the table
    .venv/bin/python benchmarks/export_stall.py --steps 3 --backends torch
    .venv/bin/python benchmarks/export_stall.py --json /tmp/stall.json

The BPE test model (Qwen3-shaped: `rollart build-model --preset qwen3-bpe`) is built into a temp folder and trained
in fp32 (`threads: 1` per rank, so that 2 ranks fit the 2 cores) on batches of `ROWS` random rows of up to 48
prompt and 48 response tokens. After each step the weights are published as the trainer node does it
(`Learner.publish`): the export is ordered before the next step (`begin_export`, in bf16, the generators' usual
dtype) and, once it is out, handed to a `WeightPublisher` (`publish`), whose packer checksums it in the
background. No generator listens: a push's network side runs in the trainer's event loop and the generators' own
processes, not in its step.

The stall of one push is what the trainer waits for it, as the learner counts it: `begin_export` itself, the next
step's wait behind the export (the ranks run it first: ordered, so a version never mixes two steps), and the next
optimizer step's wait for the packer (`wait_packed`: it must not change tensors the packer still reads). The step
is the training step's own time without that wait. Medians over `--steps` steps after one warm-up.

The script uses only `export_weights` and `WeightPublisher.publish` where an engine has no `begin_export`, so with
PYTHONPATH at a checkout of another commit it measures that commit's export the way its learner ran it (before the
shared-memory export: `git worktree add /tmp/before 890d5fe`, then
`PYTHONPATH=/tmp/before .venv/bin/python benchmarks/export_stall.py`): there, export and publish both held it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import pack_batch
from rollart.models.qwen3_bpe import build_qwen3_bpe_model
from rollart.protocol import Identity, SessionConfig
from rollart.testkit.batches import Seq
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec
from rollart.weights.config import WeightsSpec
from rollart.weights.publisher import WeightPublisher

ROWS = 24
WIRE = torch.bfloat16


def batch(seed: int, vocab: int) -> Any:
    rng = random.Random(seed)
    seqs = []
    for _ in range(ROWS):
        prompt, response = rng.randint(8, 48), rng.randint(8, 48)
        seqs.append(
            Seq(
                [rng.randint(5, vocab - 1) for _ in range(prompt)],
                [rng.randint(5, vocab - 1) for _ in range(response)],
                [1] * response,
                [rng.uniform(-9.5, -8.5) for _ in range(response)],
                [1] * response,
            )
        )
    return pack_batch(seqs, [rng.uniform(-1, 1) for _ in seqs], pad_id=0)


class Push:
    """One version's export, finished and handed to the publisher in a thread of its own (the learner's task)."""

    def __init__(self, engine: Any, publisher: WeightPublisher, version: int) -> None:
        started = time.perf_counter()
        self.exported_at = 0.0
        if hasattr(engine, "begin_export"):
            exporting = engine.begin_export(WIRE)
            self.held = time.perf_counter() - started
            owned = engine.exports_copies(WIRE)
            self._thread = threading.Thread(target=self._finish, args=(exporting, publisher, version, owned))
            self._thread.start()
        else:  # an engine from before `begin_export`: its learner exported and published inside the step lock
            weights = engine.export_weights(WIRE)
            self.exported_at = time.perf_counter()
            publisher.publish(version, weights, owned=engine.exports_copies(WIRE))
            self.held = time.perf_counter() - started
            self._thread = None
        self.export_s = 0.0
        self._started = started

    def _finish(self, exporting: Any, publisher: WeightPublisher, version: int, owned: bool) -> None:
        weights = exporting.result()
        self.exported_at = time.perf_counter()
        publisher.publish(version, weights, owned=owned)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.export_s = self.exported_at - self._started


def measure(backend: str, model_dir: Path, vocab: int, steps: int) -> dict[str, Any]:
    ranks = 2 if backend == "fsdp2" else 1
    spec = TrainerSpec(backend=backend, ranks=ranks, device="cpu", threads=1, micro_batch_size=ROWS, lr=1e-5)
    engine = build_training_engine(spec, model_dir, seed=0)
    publisher = WeightPublisher(Identity("trainer", "trainer"), b"bench", SessionConfig(), WeightsSpec(transport="tcp"))
    stalls, step_s, exports, helds = [], [], [], []
    push: Push | None = None
    try:
        for step in range(steps + 2):
            waited = publisher.wait_packed() if push is not None else 0.0
            sent = time.perf_counter()
            engine.train_step(batch(step, vocab), version=step)
            took = time.perf_counter() - sent
            if push is not None:
                push.join()
                queued = max(0.0, push.exported_at - sent)
                if step > 1:  # the warm-up step's push is not counted
                    stalls.append(push.held + waited + queued)
                    step_s.append(took - queued)
                    exports.append(push.export_s)
                    helds.append(push.held)
            if step <= steps:
                push = Push(engine, publisher, step + 1)
            print(f"{backend}: step {step} {took:.2f} s", file=sys.stderr, flush=True)
        publisher.wait_packed()
    finally:
        engine.close()
    stall, step_time = statistics.median(stalls), statistics.median(step_s)
    return {
        "backend": f"{backend}, {ranks} rank{'s' if ranks > 1 else ''}",
        "api": "begin_export" if hasattr(engine, "begin_export") else "export_weights",
        "step_s": step_time,
        "export_s": statistics.median(exports),
        "held_s": statistics.median(helds),
        "stall_s": stall,
        "stall_frac": stall / step_time,
        "stalls_ms": [round(1000 * s) for s in stalls],
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| trainer | export API | step s (median) | export s (until out) | held by the export call s | stall per "
        "push s | stall / step | stall per push, every step (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['api']} | {r['step_s']:.2f} | {r['export_s']:.3f} | {r['held_s']:.4f} "
            f"| {r['stall_s']:.3f} | {r['stall_frac']:.3f} | {', '.join(str(s) for s in r['stalls_ms'])} |"
        )
    return lines


def run(backends: list[str], steps: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollart-bench-") as folder:
        model_dir = build_qwen3_bpe_model(Path(folder) / "model", seed=0)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        for backend in backends:
            rows.append(measure(backend, model_dir, vocab, steps))
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per backend, after one warm-up")
    parser.add_argument("--backends", nargs="+", choices=["fsdp2", "torch"], default=["fsdp2", "torch"])
    parser.add_argument("--json", type=Path, default=None, help="the rows as JSON too (benchmarks/weight_sync.py)")
    args = parser.parse_args()
    rows = run(args.backends, args.steps)
    print("\n".join(table(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
