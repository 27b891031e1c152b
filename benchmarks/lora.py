"""LoRA against full fine-tuning, side by side on the BPE test model: push bytes and time, step time, peak memory.

    .venv/bin/python benchmarks/lora.py                  # writes benchmarks/results/lora.md
    .venv/bin/python benchmarks/lora.py --steps 3 --out /tmp/lora.md

The model is `rollart build-model --preset qwen3-bpe` (29.3 M parameters, Qwen3's shape, saved in bf16). Each
variant runs in its own process (so one's memory does not count in the other's peak), one after the other:
- **full**: the torch backend training every weight (fp32 master weights, AdamW);
- **LoRA**: the same backend with `trainer.lora: {rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj,
  o_proj]}`: the base frozen, AdamW state for the adapters alone.

In each: `--warmup` steps, then `--steps` measured ones on the same random batch (`--rows` rows of up to
`--tokens` tokens, the second half of each row the response), then one weight push of `export_weights(bf16)`
(what generators of `dtype: bfloat16` are sent) through the real weight path over loopback TCP (publisher ->
receiver, `rollart.testkit.push`) into a transformers engine holding the same base, which loads it (full: the
weights; LoRA: the adapters, merged into its copy of the base). Columns: the medians over the measured steps of
the step's wall time and of the process's peak resident memory during the step (VmHWM, reset each step:
everything the process touched), the model state the trainer holds (parameters, gradients, optimizer state),
and the push's bytes on the wire and its time from publish to acknowledgement (the engine's load included).
The last line is `summary: lora_push_bytes_over_full=X.XXX`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check import random_batch  # benchmarks/: the GPU check's batch maker, a sibling script
from machine import describe

from rollart.generation.hf.engine import HFEngine
from rollart.lora.spec import LoraSpec
from rollart.models.qwen3_bpe import build_qwen3_bpe_model
from rollart.testkit.push import push_once
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec

ROOT = Path(__file__).resolve().parents[1]
LORA = LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
VARIANTS = {"full": None, "lora": LORA}


def measure(model: Path, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's numbers, in this process."""
    torch.manual_seed(0)
    spec = TrainerSpec(device="cpu", lr=1e-4, micro_batch_size=args.rows, threads=args.threads, lora=VARIANTS[variant])
    engine = build_training_engine(spec, model, seed=0)
    batch = random_batch(0, rows=args.rows, tokens=args.tokens, vocab=args.vocab)
    steps: list[dict[str, float]] = []
    for i in range(args.warmup + args.steps):
        began = time.perf_counter()
        out = engine.train_step(batch, version=i + 1)
        out["step_s"] = time.perf_counter() - began
        if i >= args.warmup:
            steps.append(out)
    weights = engine.export_weights(torch.bfloat16)
    tensor_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    pushed = asyncio.run(_push(model, weights, spec.lora))
    engine.close()
    return {
        "variant": variant,
        "step_s": statistics.median(s["step_s"] for s in steps),
        "peak_gib": statistics.median(s["peak_bytes_r0"] for s in steps) / 2**30,
        "state_mib": steps[-1]["state_bytes_r0"] / 2**20,
        "tensors": len(weights),
        "tensor_bytes": tensor_bytes,
        "push_bytes": pushed["bytes"],
        "push_s": pushed["seconds"],
    }


async def _push(model: Path, weights: dict[str, torch.Tensor], lora: LoraSpec | None) -> dict[str, float]:
    engine = HFEngine(model, max_batch_size=4, dtype=torch.bfloat16)
    await engine.start()
    try:

        async def apply(version: int, tensors: Any) -> None:
            if lora is None:
                await engine.load_weights(version, tensors)
            else:
                await engine.load_adapter(version, tensors, lora)

        pushed = await push_once(apply, 1, weights, dtype=torch.bfloat16, timeout=300)
    finally:
        await engine.close()
    return {"bytes": pushed.stats.bytes_received, "seconds": pushed.seconds}


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    full, lora = results["full"], results["lora"]
    rows = [
        ("push bytes (bf16 on the wire)", "push_bytes", lambda v: f"{v / 2**20:.2f} MiB"),
        ("push time (publish to acknowledged, engine load included)", "push_s", lambda v: f"{v:.3f} s"),
        ("tensors pushed", "tensors", lambda v: f"{v}"),
        ("trainer step (median)", "step_s", lambda v: f"{v:.2f} s"),
        ("peak resident memory during a step (median)", "peak_gib", lambda v: f"{v:.2f} GiB"),
        ("model state held (parameters, gradients, AdamW)", "state_mib", lambda v: f"{v:.1f} MiB"),
    ]
    lines = [
        "# LoRA against full fine-tuning: push, step, memory",
        "",
        f"- command: `{command}`",
        f"- machine: {describe(['torch', 'transformers', 'peft'])}",
        f"- model: the BPE test model (`rollart build-model --preset qwen3-bpe`, 29.3 M parameters, bf16 on disk); "
        f"batch {args.rows} rows of up to {args.tokens} tokens; {args.warmup} warm-up and {args.steps} measured "
        f"steps, {args.threads} torch thread(s); LoRA rank {LORA.rank}, alpha {LORA.alpha:g}, on "
        f"{', '.join(LORA.target_modules)}",
        "- what each column is: benchmarks/lora.py's docstring",
        "",
        "| | full fine-tuning | LoRA | LoRA / full |",
        "|---|---|---|---|",
    ]
    for label, key, show in rows:
        ratio = lora[key] / full[key] if full[key] else float("nan")
        lines.append(f"| {label} | {show(full[key])} | {show(lora[key])} | {ratio:.3f} |")
    lines += [
        "",
        f"The receiver took {lora['push_bytes']:,} payload bytes with LoRA, the adapters' {lora['tensor_bytes']:,} "
        f"bytes in bf16 and nothing else, against {full['push_bytes']:,} for the whole model "
        f"({full['tensor_bytes']:,} bytes of tensors; bucket manifests and framing are not counted in either).",
        "",
        f"summary: lora_push_bytes_over_full={lora['push_bytes'] / full['push_bytes']:.3f}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora.md")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="the BPE test model (default: built in a temp dir)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant is not None:  # a child: one variant, its numbers as JSON
        from transformers import AutoConfig

        args.vocab = AutoConfig.from_pretrained(str(args.model), local_files_only=True).vocab_size
        args.json.write_text(json.dumps(measure(args.model, args.variant, args)))
        return 0
    command = "python benchmarks/lora.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_qwen3_bpe_model(Path(scratch) / "qwen3-bpe", seed=0)
        results = {}
        for variant in VARIANTS:
            out = Path(scratch) / f"{variant}.json"
            child = [sys.executable, __file__, "--variant", variant, "--json", str(out), "--model", str(model)]
            child += [f"--{key}={getattr(args, key)}" for key in ("steps", "warmup", "rows", "tokens", "threads")]
            print(f"lora benchmark: {variant} ...", file=sys.stderr, flush=True)
            subprocess.run(child, check=True)
            results[variant] = json.loads(out.read_text())
    text = report(results, args, command.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
