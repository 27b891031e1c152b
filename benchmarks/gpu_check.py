"""The GPU check: GRPO steps of the real training engines, HF-engine generation and a weight push into
it, on a Qwen3-1.7B-shaped model, bf16.

Run it through `bin/gpu-check` (which puts this checkout and the wheels the GPU machine lacks on
`PYTHONPATH`), from the repository root:

    bin/gpu-check                      # one GPU: the table on stdout and in $OUT/gpu-check.md (and .json)
    bin/gpu-check --cpu-smoke          # the same code on CPU with a tiny shape, in seconds (a test runs it)
    bin/gpu-check --out FILE.md        # write the table there instead

It builds the model here, with random weights (nothing is downloaded): Qwen3-1.7B's shape (hidden
2048, 28 layers, 16 heads of 128, 8 KV heads, MLP 6144, vocabulary 151,936, tied embeddings, about
1.72 B parameters), saved in Hugging Face format in bf16, with the tiny model's character
tokenizer (the engine needs only pad and eos; the batch's token ids are random over the whole
vocabulary). Then each training row builds a training engine (`build_training_engine`, as the
trainer node does), takes `--warmup` steps and `--steps` measured ones on the same kind of batch
(`--rows` rows of `--tokens` tokens at most, lengths uniform over [tokens/2, tokens], the second
half of each row the response), takes `export_weights()` once, and closes it. The generation row,
the weight-push row (one training step, its export pushed over loopback TCP into an `HFEngine`,
whose greedy output is then checked against a fresh model holding the exported weights) and the
megatron row (skipped, with the reason, where that backend or `megatron.core` is missing, and on
CPU) are described in `benchmarks/gpu_check_rows.py`. Each row's line is written as soon as it is
measured, so a run cut short still leaves the rows it finished; a row that fails says why and the
next one runs. The rows, in order (`--only N`): fsdp2 fp32 master, torch, generation, weight push,
CUDA IPC (an 8B-shaped version between two processes, a few seconds), megatron, fsdp2 pure bf16, fsdp2 with
activation checkpointing.

Time, measured on an H200 (benchmarks/results/gpu/README.md): 15 s to build the model, 25-60 s per
training row (fsdp2's rank process starts in 15-18 s), 25 s for generation, 15 s for the push; the
whole table in about 4 minutes, the CUDA tests after it (bin/gpu-check) in 1 more. No row starts after
`--budget-s` (300 s; the last rows are the first to be cut).

What the columns mean:
- step s: the median wall time of `train_step` as the trainer node calls it (one optimizer step;
  the push row: its one step);
- tokens/s: the batch's real (unpadded) tokens over step s; generation: generated tokens over the
  round's wall time;
- MFU: 6 x parameters x real tokens / step s / peak (`--peak-tflops`, 989: an H200's dense bf16).
  6 x parameters counts the forward and backward matmuls per token; attention scores and the
  output head's recomputation in the chunked log-probs are not counted, nor padding;
- peak GiB: the rank's `torch.cuda.max_memory_allocated` over a step (`peak_bytes_r0`);
  generation: over the measured round; push: from its training step on (trainer, engine, reference);
- state GiB: parameters, gradients and optimizer state the rank holds (`state_bytes_r0`);
- export s: one `export_weights()`, the weights by Hugging Face name as the weight push takes them
  (fsdp2: gathered and sent from the rank process in buckets; torch: tensors that alias the live
  parameters, nothing copied);
- push GiB/s: bytes received over the wall time from `publish` to the receiver's acknowledgement;
- start s: loading the engine(s); notes: what a generation or push row did, and the greedy check.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Literal

import torch
from gpu_check_rows import (  # benchmarks/gpu_check_rows.py
    measure_cuda_ipc,
    measure_generation,
    measure_push,
    megatron_unavailable,
)
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script

from rollart.algorithms.grpo import PackedBatch
from rollart.logs import configure_logging
from rollart.tiny.model import EOS_TOKEN, PAD_TOKEN, build_tokenizer
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's dimensions (Qwen3Config's names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


QWEN3_1_7B = Shape(2048, 28, 16, 8, 128, 6144, 151936)
SMOKE = Shape(64, 2, 4, 2, 16, 128, 512)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    spec: dict[str, Any]
    """TrainerSpec fields on top of the common ones (generate: none)."""
    micro_batch_scale: float = 1.0
    """micro_batch_tokens: this many times --micro-batch-tokens."""
    kind: Literal["train", "generate", "push", "ipc"] = "train"


ROWS = [
    Row("fsdp2, 1 rank, fp32 master, bf16 compute", {"backend": "fsdp2", "precision": "bf16"}),
    Row("torch, bf16 autocast, fp32 master", {"backend": "torch", "precision": "bf16"}),
    Row("HF engine generate, bf16, concurrent requests", {}, kind="generate"),
    Row(
        "weight push: torch step -> loopback TCP -> HF engine, greedy check",
        {"backend": "torch", "precision": "bf16"},
        kind="push",
    ),
    Row("CUDA IPC: an 8B-shaped bf16 version shared by one process, copied on the device by another", {}, kind="ipc"),
    Row(  # without Transformer Engine, Megatron's attention is unfused: each layer keeps its [rows, heads,
        # T, T] scores for the backward pass, and at 16,384 tokens a micro-batch the whole did not fit
        # on 140 GiB (a CUDA out-of-memory error, the first GPU run)
        "megatron, tp 1, pp 1, fp32 master, bf16 compute, 1/4 micro-batch",
        {"backend": "megatron", "precision": "bf16", "tensor_parallel": 1, "pipeline_parallel": 1},
        micro_batch_scale=0.25,
    ),
    Row("fsdp2, 1 rank, pure bf16", {"backend": "fsdp2", "master_dtype": "bf16"}),
    Row(
        "fsdp2, 1 rank, fp32 master, bf16 compute, activation checkpointing, 4x micro-batch",
        {"backend": "fsdp2", "precision": "bf16", "activation_checkpointing": True},
        micro_batch_scale=4.0,
    ),
]
"""The rows, most important first (what has never run on a GPU before the variants)."""


def build_model(folder: Path, shape: Shape, device: str) -> int:
    """A Qwen3 of `shape` with random weights, saved in bf16 with a tokenizer; returns its parameters."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        **dataclasses.asdict(shape),
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)  # type: ignore[no-untyped-call]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return parameters


def random_batch(seed: int, *, rows: int, tokens: int, vocab: int) -> PackedBatch:
    """`rows` rows of tokens/2 to `tokens` random ids; the second half of each row is the response,
    with behaviour log-probs near a uniform policy's and advantages of +-1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)
    positions = torch.arange(tokens)[None, :]
    attention_mask = (positions < lengths[:, None]).long()
    loss_mask = ((positions >= (lengths // 2)[:, None]) & (attention_mask > 0)).float()
    input_ids = torch.randint(5, vocab, (rows, tokens), generator=g) * attention_mask
    behaviour = (-math.log(vocab) + 0.1 * torch.randn(rows, tokens, generator=g)) * loss_mask
    advantages = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * loss_mask
    versions = torch.where(loss_mask > 0, 0, -1).long()
    sources = torch.full((rows, tokens), -1, dtype=torch.long)
    return PackedBatch(
        input_ids, attention_mask, loss_mask, behaviour, advantages, versions, sources, torch.ones(rows, tokens)
    )


def run_row(row: Row, model: Path, parameters: int, args: argparse.Namespace) -> dict[str, Any]:
    """The row's numbers, or {"skipped": why} for a row this machine cannot run."""
    micro_batch_tokens = int(args.micro_batch_tokens * row.micro_batch_scale)
    spec = {"device": args.device, "lr": 1e-6, "micro_batch_tokens": micro_batch_tokens}
    spec |= row.spec | ({"threads": 1} if args.device == "cpu" else {})
    if row.kind == "generate":
        return measure_generation(model, args)
    if row.kind == "ipc":
        return measure_cuda_ipc(args)
    if row.kind == "push":
        batch = random_batch(0, rows=min(args.rows, 8), tokens=min(args.tokens, 256), vocab=args.vocab)
        return measure_push(model, TrainerSpec(**spec | {"lr": args.push_lr}), batch, args)
    if row.spec["backend"] == "megatron" and (why := megatron_unavailable(args.device)):
        return {"skipped": why}
    return measure(spec, model, parameters, args)


def measure(spec: dict[str, Any], model: Path, parameters: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build the row's training engine, train, export, close; the row's numbers."""
    started = time.perf_counter()
    engine = build_training_engine(TrainerSpec(**spec), model, seed=0)
    out: dict[str, Any] = {"start_s": time.perf_counter() - started, "describe": engine.describe()}
    try:
        times, peaks, tokens = [], [], []
        for step in range(args.warmup + args.steps):
            batch = random_batch(step, rows=args.rows, tokens=args.tokens, vocab=args.vocab)
            began = time.perf_counter()
            stats = engine.train_step(batch, version=0)
            took = time.perf_counter() - began
            if not math.isfinite(stats["loss"]):
                raise RuntimeError(f"step {step}: loss {stats['loss']}")
            if step >= args.warmup:
                times.append(took)
                peaks.append(stats.get("peak_bytes_r0", math.nan))  # a new backend may not say
                tokens.append(int(batch.attention_mask.sum()))
                out["state_bytes"] = stats.get("state_bytes_r0", math.nan)
        began = time.perf_counter()
        weights = engine.export_weights()
        out["export_s"] = time.perf_counter() - began
        if len(weights) < 3:
            raise RuntimeError(f"export_weights gave {len(weights)} tensors")
        del weights
        out |= export_stall(
            engine, random_batch(args.warmup + args.steps, rows=args.rows, tokens=args.tokens, vocab=args.vocab)
        )
    finally:
        engine.close()
    step_s = statistics.median(times)
    out |= {"step_s": step_s, "steps_s": times, "tokens": statistics.mean(tokens), "peak_bytes": max(peaks)}
    out["tokens_per_s"] = out["tokens"] / step_s
    if args.peak_tflops > 0:
        out["mfu"] = 6 * parameters * out["tokens"] / step_s / (args.peak_tflops * 1e12)
    return out


def export_stall(engine: Any, batch: PackedBatch) -> dict[str, Any]:
    """A push's hold on the trainer as its learner counts it: the export (bf16, the generators' dtype) ordered
    before one more step, the call itself and that step's wait behind it, over the step's own time."""
    began = time.perf_counter()
    exporting = engine.begin_export(torch.bfloat16)
    held = time.perf_counter() - began
    done_at: list[float] = []
    exporting.add_done_callback(lambda _: done_at.append(time.perf_counter()))
    sent = time.perf_counter()
    engine.train_step(batch, version=1)
    took = time.perf_counter() - sent
    exporting.result()
    while not done_at:  # the callback runs just after the result is set
        time.sleep(0.001)
    queued = max(0.0, done_at[0] - sent)
    return {"export_stall_s": held + queued, "export_stall_frac": (held + queued) / (took - queued)}


COLUMNS = [  # header, key in a row's numbers, format; "-" where a row has no such number
    ("step s", "step_s", "{:.2f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("MFU", "mfu", "{:.1%}"),
    ("peak GiB", "peak_gib", "{:.1f}"),
    ("state GiB", "state_gib", "{:.1f}"),
    ("export s", "export_s", "{:.1f}"),
    ("export stall / step", "export_stall_frac", "{:.3f}"),
    ("push GiB/s", "push_gib_s", "{:.2f}"),
    ("start s", "start_s", "{:.0f}"),
]


def notes(got: dict[str, Any]) -> str:
    """What a generation or push row did, in words."""
    if "generated_tokens" in got:
        return (
            f"{got['requests']} requests, {got['prompt_tokens']:,} prompt and {got['generated_tokens']:,} "
            f"generated tokens in {got['wall_s']:.2f} s, {got['batches']} batch(es)"
        )
    if "ipc_match" in got:
        return (
            f"{got['push_bytes'] / 1e9:.1f} GB in {got['buckets']} buckets in {got['push_s']:.3f} s (the first open "
            f"{got['first_open_s'] * 1e3:.1f} ms); bytes match: {str(got['ipc_match']).lower()}"
        )
    if "greedy_match" in got:
        return (
            f"{got['push_bytes'] / (1 << 20):,.1f} MiB in {got['push_s']:.2f} s; "
            f"greedy match: {str(got['greedy_match']).lower()} (output changed by the push: "
            f"{str(got['changed']).lower()})"
        )
    return ""


def cell(value: Any, fmt: str) -> str:
    """A number in the table; "-" for none (a row without that measure, a backend that does not say)."""
    return fmt.format(value) if isinstance(value, int | float) and math.isfinite(value) else "-"


def table(results: list[tuple[Row, dict[str, Any]]]) -> list[str]:
    lines = [
        "| row | " + " | ".join(header for header, _, _ in COLUMNS) + " | notes |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    blank = " |" * len(COLUMNS)
    for row, got in results:
        if "error" in got:
            lines.append(f"| {row.name} | failed: {got['error']} |{blank}")
            continue
        if "skipped" in got:
            lines.append(f"| {row.name} | skipped: {got['skipped']} |{blank}")
            continue
        numbers = got | {f"{key}_gib": got[f"{key}_bytes"] / GIB for key in ("peak", "state") if f"{key}_bytes" in got}
        cells = [cell(numbers.get(key), fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| {row.name} | " + " | ".join(cells) + f" | {notes(got)} |")
    return lines


def report(args: argparse.Namespace, header: list[str], results: list[tuple[Row, dict[str, Any]]]) -> str:
    skipped = [f"- skipped: {row.name}: {got['skipped']}" for row, got in results if "skipped" in got]
    text = "\n".join([*header, *(skipped or ["- skipped: nothing"]), "", *table(results), ""])
    failures = [(row, got["traceback"]) for row, got in results if "traceback" in got]
    for row, trace in failures:
        text += f"\n### {row.name}: the failure\n\n```\n{trace}```\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        raw = [{"row": row.name, "spec": row.spec} | got for row, got in results]
        args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, a tiny shape, one step per row")
    parser.add_argument("--rows", type=int, default=64, help="rows per batch (8 groups of 8)")
    parser.add_argument("--tokens", type=int, default=1024, help="the longest row's tokens")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="run.trainer.micro_batch_tokens")
    parser.add_argument("--warmup", type=int, default=1, help="steps before measuring")
    parser.add_argument("--steps", type=int, default=3, help="steps measured")
    parser.add_argument("--gen-requests", type=int, default=64, help="generation: concurrent requests")
    parser.add_argument("--gen-prompt", type=int, default=256, help="generation: the longest prompt's tokens")
    parser.add_argument("--gen-tokens", type=int, default=256, help="generation: max_tokens per request")
    parser.add_argument("--push-prompts", type=int, default=4, help="push: prompts decoded greedily")
    parser.add_argument("--push-prompt", type=int, default=64, help="push: the longest prompt's tokens")
    parser.add_argument("--push-tokens", type=int, default=32, help="push: greedy tokens per prompt")
    parser.add_argument("--push-lr", type=float, default=1e-2, help="push: the step's learning rate")
    parser.add_argument("--ipc-gb", type=float, default=16.4, help="CUDA IPC: GB shared (Qwen3-8B in bf16)")
    parser.add_argument("--ipc-bucket-mb", type=float, default=64, help="CUDA IPC: MiB a bucket")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (MFU)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no row after this many seconds")
    parser.add_argument("--only", type=int, action="append", help="run only these rows (1-based; repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="the markdown table (default: $OUT/gpu-check.md)")
    args = parser.parse_args(argv)
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "gpu-check.md"
    args.device, args.shape = "cuda", QWEN3_1_7B
    if args.cpu_smoke:
        args.device, args.shape, args.peak_tflops = "cpu", SMOKE, 0.0
        args.rows, args.tokens, args.micro_batch_tokens, args.steps = 4, 32, 64, 1
        args.gen_requests, args.gen_prompt, args.gen_tokens = 8, 16, 8
        args.push_prompts, args.push_prompt, args.push_tokens = 2, 8, 8
    args.vocab = args.shape.vocab_size
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    configure_logging(json=False)  # log lines to stderr: stdout is the table
    began = time.monotonic()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (--cpu-smoke runs the same code on CPU)", file=sys.stderr)
        return 2
    import transformers

    gpu = "CPU (smoke run: a tiny shape; no GPU measured)"
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"
    rows = [row for i, row in enumerate(ROWS, start=1) if not args.only or i in args.only]
    header = [
        f"# GPU check ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"- device: {gpu}; torch {torch.__version__}, transformers {transformers.__version__}",
        f"- machine: {describe([])}",
        f"- command: `bin/gpu-check {' '.join(sys.argv[1:] if argv is None else argv)}`",
    ]
    results: list[tuple[Row, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        model = Path(scratch) / "model"
        parameters = build_model(model, args.shape, args.device)
        shape = ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(args.shape).items())
        mfu = f"6 x {parameters:,} parameters x real tokens / step s / {args.peak_tflops:g} TFLOP/s"
        header += [
            f"- model: Qwen3, {parameters:,} parameters ({shape}), random weights, bf16 on disk, "
            f"built in {time.monotonic() - began:.0f} s",
            f"- batch: {args.rows} rows of {args.tokens // 2}-{args.tokens} tokens (half response), "
            f"micro_batch_tokens {args.micro_batch_tokens}; {args.warmup} warm-up step(s), median of {args.steps}",
            f"- MFU: {mfu}" + (" (H200 dense bf16)" if args.peak_tflops == 989.0 else "")
            if args.peak_tflops > 0
            else "- MFU: not computed (no peak FLOP/s for this device)",
            f"- generation: HFEngine bf16, {args.gen_requests} concurrent requests of {args.gen_prompt // 2}-"
            f"{args.gen_prompt} random prompt tokens, up to {args.gen_tokens} tokens each at temperature 1",
            f"- weight push: one torch step (lr {args.push_lr:g}), export in bf16, WeightPublisher -> loopback TCP -> "
            f"WeightReceiver -> HFEngine.load_weights in one process; greedy check: {args.push_prompts} prompts x "
            f"{args.push_tokens} tokens, one at a time, against a fresh model holding the exported weights",
        ]
        for row in rows:
            if time.monotonic() - began > args.budget_s:
                results.append((row, {"skipped": f"past the {args.budget_s:.0f} s budget"}))
                continue
            print(f"gpu-check: {row.name} ...", file=sys.stderr, flush=True)
            try:
                results.append((row, run_row(row, model, parameters, args)))
            except Exception as exc:  # the next row still runs; the table says what failed
                error = f"{type(exc).__name__}: {exc}".replace("|", "/").replace("\n", " ")[:200]
                results.append((row, {"error": error, "traceback": traceback.format_exc()}))
            gc.collect()  # the row's engine (model, optimizer) and its cycles, before the next row
            if args.device == "cuda":
                torch.cuda.empty_cache()
            report(args, header, results)
    print(report(args, header, results))
    failed = any("traceback" in got or got.get("greedy_match") is False for _, got in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
