"""The GPU check's generation, weight-push and Megatron rows; `benchmarks/gpu_check.py` runs them.

They use the model that script builds (Qwen3-1.7B's shape, random weights, bf16; a tiny shape with
`--cpu-smoke`). The 1.7B shape is kept for the engine rows too: one H200 decodes a batch of it with
transformers' `generate` in some tens of milliseconds per step, so the rows stay well under a minute.

- generation: `HFEngine` (bf16, on the check's device), `--gen-requests` concurrent requests of
  `--gen-prompt`/2 to `--gen-prompt` random prompt tokens, each sampled at temperature 1 up to
  `--gen-tokens` tokens, `max_batch_size` = the requests, so they run as one batch after a short
  warm-up round. tokens/s: generated tokens over the measured round's wall time (first request in
  to last answer); peak GiB: the device's high-water mark over that round.
- weight push: the torch training engine takes one GRPO step (`--push-lr` 1e-2: Adam's first step
  moves every weight by about that, so the greedy tokens change); `export_weights(bf16)` goes through the real
  weight path: `WeightPublisher` -> loopback TCP -> a `SessionServer` whose bulk connections a
  `WeightReceiver` serves -> `HFEngine.load_weights`, the way the learner and a generator node do,
  but in one process on one event loop (uvloop when installed), so both ends share a core.
  push GiB/s: the bytes received over the wall time from `publish` to the acknowledgement (packing
  from the device, checksums, TCP, checks, staging in the engine). Then `--push-prompts` prompts
  are decoded greedily for `--push-tokens` tokens, one request at a time, and compared with a fresh
  Hugging Face model loaded with the trainer's exported weights, same dtype and device, decoding
  the same prompts alone with `generate`: "greedy match" is token-for-token equality (and every
  token made under the pushed version); "changed" says whether the push changed the engine's
  output at all, without which a match would prove little.
- CUDA IPC: one process holds an 8B-shaped version in bf16 (`--ipc-gb`, 16.4 GB: Qwen3-8B's weights) on the GPU
  and shares it bucket by bucket (`--ipc-bucket-mb` each: `rollart.weights.cuda_ipc.share`); another process of
  the same GPU opens every bucket and copies it device to device into a buffer of its own. push GiB/s: the bytes
  over the wall time from opening the first bucket to the last copy's end; the first open (mapping the
  allocation) is timed apart. What the `cuda_ipc` transport will do between a trainer's and a generator's GPUs
  (on one GPU here, so the copy reads and writes the same HBM; across GPUs NVLink or PCIe sets the rate); the
  receiving engine's pause is not part of it (no engine takes a version this way yet). Skipped on CPU.
- megatron: a training row like the others, `backend: megatron` with tensor and pipeline parallel 1,
  when this checkout registers that backend and `megatron.core` imports; otherwise, and always on
  CPU (Megatron-Core's forward needs CUDA), skipped with the reason (`megatron_unavailable`).

Time (estimated, not measured: none of this has run on a GPU yet): generation about 30 s (engine
load ~10 s, 64 x 256 tokens at ~30-40 ms per decode step ~10 s); weight push about 60-90 s (trainer
load ~20 s, one step, 3.4 GB pushed at ~1 GiB/s ~4 s, engine and reference loads ~10 s each);
megatron about a minute like the other training rows.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import multiprocessing
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.generation.engine import GenerationResult, SamplingParams
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from rollart.testkit.push import push_once
from rollart.training.memory import peak_bytes, reset_peak
from rollart.training.registry import TRAINING_BACKENDS, build_training_engine
from rollart.training.spec import TrainerSpec
from rollart.weights.cuda_ipc import SharedCuda, open_shared, share
from rollart.weights.receiver import ApplyWeights

T = TypeVar("T")
WIRE_DTYPE = torch.bfloat16
"""What the engines run in and the weights travel as."""
PUSH_TIMEOUT_S = 180.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on uvloop, as the nodes do, or on asyncio's loop where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def random_prompts(seed: int, count: int, longest: int, vocab: int) -> list[list[int]]:
    """`count` prompts of longest/2 to `longest` random ids above the special tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, longest // 2), longest + 1, (count,), generator=g).tolist()
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


async def generate_all(
    engine: HFEngine, prompts: list[list[int]], params: SamplingParams, tag: str
) -> list[GenerationResult]:
    """Every prompt as its own concurrent request; the results in prompt order."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(engine.generate(f"{tag}-{i}", p, params)) for i, p in enumerate(prompts)]
    return [task.result() for task in tasks]


# -- generation ----------------------------------------------------------------------------------


def measure_generation(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    return run(_generation(model, args))


async def _generation(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    began = time.perf_counter()
    engine = HFEngine(model, max_batch_size=args.gen_requests, dtype=WIRE_DTYPE, device=args.device)
    await engine.start()
    out: dict[str, Any] = {"start_s": time.perf_counter() - began}
    prompts = random_prompts(1, args.gen_requests, args.gen_prompt, args.vocab)
    try:
        await generate_all(engine, prompts, SamplingParams(max_tokens=4, temperature=1.0), "warm-up")
        batches = engine.batches_run
        reset_peak(device)
        began = time.perf_counter()
        results = await generate_all(
            engine, prompts, SamplingParams(max_tokens=args.gen_tokens, temperature=1.0), "gen"
        )
        wall = time.perf_counter() - began
        out["peak_bytes"] = peak_bytes(device)
        out["batches"] = engine.batches_run - batches
    finally:
        await engine.close()
    generated = sum(len(r.token_ids) for r in results)
    if generated == 0 or not all(math.isfinite(p) for r in results for p in r.logprobs):
        raise RuntimeError(f"{generated} tokens generated, or log-probs not finite")
    out |= {"requests": len(prompts), "prompt_tokens": sum(r.prompt_tokens for r in results)}
    return out | {"generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall}


# -- weight push ---------------------------------------------------------------------------------


def measure_push(model: Path, spec: TrainerSpec, batch: PackedBatch, args: argparse.Namespace) -> dict[str, Any]:
    """Train one step, push the export into an engine, check its greedy output; the row's numbers."""
    device = torch.device(args.device)
    reset_peak(device)
    began = time.perf_counter()
    trainer = build_training_engine(spec, model, seed=0)
    out: dict[str, Any] = {"start_s": time.perf_counter() - began, "describe": trainer.describe()}
    prompts = random_prompts(2, args.push_prompts, args.push_prompt, args.vocab)
    try:
        began = time.perf_counter()
        stats = trainer.train_step(batch, version=0)
        out["step_s"] = time.perf_counter() - began
        if not math.isfinite(stats["loss"]):
            raise RuntimeError(f"loss {stats['loss']}")
        began = time.perf_counter()
        weights = trainer.export_weights(WIRE_DTYPE)
        owned = trainer.exports_copies(WIRE_DTYPE)
        out["export_s"] = time.perf_counter() - began
        before, after, pushed = run(_push_and_decode(model, weights, owned, prompts, args))
        reference = reference_greedy(model, weights, prompts, args)
    finally:
        trainer.close()
    out |= pushed | {"peak_bytes": peak_bytes(device)}
    tokens = [r.token_ids for r in after]
    out["greedy_match"] = tokens == reference and all(r.versions == [1] * len(r.token_ids) for r in after)
    out["changed"] = tokens != [r.token_ids for r in before]
    out["start_s"] += out.pop("engine_start_s")
    return out


async def _push_and_decode(
    model: Path, weights: Mapping[str, torch.Tensor], owned: bool, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[list[GenerationResult], list[GenerationResult], dict[str, Any]]:
    """A fresh engine's greedy results for `prompts` (one request at a time), the push of `weights`
    into it as version 1, then its greedy results again; with the push's numbers."""
    began = time.perf_counter()
    engine = HFEngine(model, max_batch_size=1, dtype=WIRE_DTYPE, device=args.device)
    await engine.start()
    numbers: dict[str, Any] = {"engine_start_s": time.perf_counter() - began}
    greedy = SamplingParams(max_tokens=args.push_tokens, temperature=0.0)
    try:
        before = [await engine.generate(f"before-{i}", p, greedy) for i, p in enumerate(prompts)]
        numbers |= await push(engine.load_weights, weights, owned=owned)
        after = [await engine.generate(f"after-{i}", p, greedy) for i, p in enumerate(prompts)]
    finally:
        await engine.close()
    return before, after, numbers


async def push(apply: ApplyWeights, weights: Mapping[str, torch.Tensor], *, owned: bool) -> dict[str, Any]:
    """Publish `weights` as version 1 to a receiver on a loopback port whose `apply` is given
    (`rollart.testkit.push`); wait for its acknowledgement (after `apply` returned). Returns bytes and seconds."""
    try:
        pushed = await push_once(apply, 1, weights, dtype=WIRE_DTYPE, owned=owned, timeout=PUSH_TIMEOUT_S)
    except TimeoutError as exc:
        raise RuntimeError(f"the push was not acknowledged: {exc}") from None
    stats, took = pushed.stats, pushed.seconds
    if stats.applied != 1 or stats.checksum_failures or stats.apply_failures:
        raise RuntimeError(f"the receiver applied {stats.applied} versions ({stats})")
    return {
        "push_bytes": stats.bytes_received,
        "push_s": took,
        "push_gib_s": stats.bytes_received / took / (1 << 30),
        "receive_s": stats.last_receive_s,
        "apply_s": stats.last_apply_s,
    }


def reference_greedy(
    model: Path, weights: Mapping[str, torch.Tensor], prompts: list[list[int]], args: argparse.Namespace
) -> list[list[int]]:
    """Each prompt's greedy tokens from a fresh Hugging Face model holding `weights`, decoded alone
    with `generate`, stopping where the engine stops (its EOS ids, `--push-tokens`)."""
    from transformers import GenerationConfig

    lm, tokenizer = load_model_and_tokenizer(model, dtype=WIRE_DTYPE, device=args.device)
    lm.load_state_dict(dict(weights))
    eos = {*_ids(tokenizer.eos_token_id), *_ids(lm.generation_config.eos_token_id)}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=args.push_tokens, do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad, use_cache=True
    )
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=args.device)
            out = lm.generate(  # type: ignore[operator]
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            tokens.append(out[0, len(prompt) :].tolist())
    del lm
    return tokens


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


# -- megatron ------------------------------------------------------------------------------------


def megatron_unavailable(device: str) -> str | None:
    """Why the megatron row cannot run here, or None when it can."""
    if device != "cuda":
        return "not run on CPU: Megatron-Core's forward needs CUDA (its RNG tracker and RoPE)"
    if "megatron" not in TRAINING_BACKENDS:
        return "this checkout has no megatron backend (TRAINING_BACKENDS in rollart/training/registry.py)"
    try:
        importlib.import_module("megatron.core")
    except ImportError as exc:
        return f"megatron.core does not import ({exc})"
    return None


def _ipc_owner(pipe: Any, nbytes: int, bucket: int) -> None:
    """The sharing process: a version's bytes on the GPU, shared bucket by bucket; kept until the reader is done."""
    version = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    version.random_(0, 256)
    torch.cuda.synchronize()
    handles = [share(version[at : at + bucket]) for at in range(0, nbytes, bucket)]
    pipe.send([msgspec.msgpack.encode(h) for h in handles])
    pipe.send(int(version[::4096].sum(dtype=torch.int64)))
    pipe.recv()  # "done": only then may the buffer go


def measure_cuda_ipc(args: argparse.Namespace) -> dict[str, Any]:
    """Share a version from another process and copy it device to device; the row's numbers (module docstring)."""
    if args.device != "cuda":
        return {"skipped": "CUDA IPC needs a CUDA GPU"}
    nbytes, bucket = int(args.ipc_gb * 1e9), int(args.ipc_bucket_mb * (1 << 20))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    began = time.perf_counter()
    owner = ctx.Process(target=_ipc_owner, args=(theirs, nbytes, bucket))
    owner.start()
    try:
        if not ours.poll(300):
            raise RuntimeError(f"the sharing process sent nothing (exit code {owner.exitcode})")
        handles = [msgspec.msgpack.decode(raw, type=SharedCuda) for raw in ours.recv()]
        sampled = ours.recv()
        start_s = time.perf_counter() - began
        staged = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        views = [open_shared(handles[0])]
        first_open_s = time.perf_counter() - t0
        views += [open_shared(h) for h in handles[1:]]
        for h, view in zip(handles, views, strict=True):
            at = h.offset - handles[0].offset
            staged[at : at + h.nbytes].copy_(view, non_blocking=True)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        matched = int(staged[::4096].sum(dtype=torch.int64)) == sampled
        del views
        ours.send("done")
    finally:
        owner.join(60)
        if owner.is_alive():
            owner.kill()
    if not matched:
        raise RuntimeError("the copied bytes differ from the shared ones")
    return {
        "push_bytes": nbytes,
        "push_s": took,
        "push_gib_s": nbytes / took / (1 << 30),
        "first_open_s": first_open_s,
        "buckets": len(handles),
        "start_s": start_s,
        "ipc_match": matched,
    }
