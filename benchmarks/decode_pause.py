"""How long an engine stops decoding while a new version is pushed into it, against the swap alone.

Run from the repository root with the vLLM environment (it has transformers too; one vLLM engine start, ~30 s):

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/decode_pause.py                 # prints the table
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/decode_pause.py --engines hf --rounds 2
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/decode_pause.py --out benchmarks/results/decode_pause.md

The BPE test model (Qwen3-shaped: `rollart build-model --preset qwen3-bpe`, run here in fp32) is built into a temp
folder. Per engine (vLLM: one worker, bound to core 1; the transformers engine: in this process), 4 clients keep it
decoding (requests of 128 greedy tokens, back to back), and this process reads the engine's generated-token count
(`load().generated_tokens`) every 0.5 ms: a gap between two increases is time in which no token came out.

Per round: a quiet window of 1.5 s with no push, then one version pushed the way a run pushes it (`WeightPublisher`
-> loopback TCP -> `WeightReceiver`, into shared memory for vLLM as its generator node receives -> `load_weights`).
Three views of the pause:
- the callers': the longest gap between tokens in the quiet window and during the push (vLLM only: the
  transformers engine counts a batch's tokens when the batch ends). On 2 cores it is noisy both ways: the push's
  own work in this process (publisher, receiver, checksums) delays reading the engine's output, which can lengthen
  a gap or merge two steps' outputs into one read and shorten it;
- the longest weight call's wall time seen from this process (vLLM): an upper bound, as it also counts the wait
  for the step in progress to end;
- the engine's stop, timed where the work runs (`engine_side`), against the swap alone: the time the version's
  copy into the engine's weights takes by itself. vLLM: the workers' in-place reload as they time it
  (`worker_swap_s`: vLLM's layerwise reload, which on CPU also repacks each layer for oneDNN); transformers:
  copying the version into a model of the same shape, timed here with nothing else going on.
The first round is a warm-up; the table gives the longest stop over the others, the median swap, and the largest
ratio of a round's stop to the same round's swap (the swap's own time varies by half from round to round here).

The script uses the engines' public API and their logs, so with PYTHONPATH at a checkout of another commit it
measures that commit's engines (before the staged route: `git worktree add /tmp/before 890d5fe`, then
`PYTHONPATH=/tmp/before .venv-vllm/bin/python benchmarks/decode_pause.py --engines vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import inspect
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script
from structlog.testing import capture_logs

from rollart.generation.engine import SamplingParams
from rollart.models.loading import load_model_and_tokenizer
from rollart.models.qwen3_bpe import build_qwen3_bpe_model
from rollart.testkit.push import push_once

CLIENTS = 4
TOKENS = 128
POLL_S = 0.0005
QUIET_S = 1.5


def noisy(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (tensor.float() + 0.01 * torch.randn(tensor.shape, generator=generator)).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"  # tied to the embeddings, as a trainer sends it
    }


class GapWatch:
    """The longest time between two increases of the engine's generated-token count, per window."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.longest = 0.0

    async def run(self) -> None:
        count, last = self.engine.load().generated_tokens, time.perf_counter()
        while True:
            await asyncio.sleep(POLL_S)
            now, seen = time.perf_counter(), self.engine.load().generated_tokens
            if seen != count:
                self.longest = max(self.longest, now - last)
                count, last = seen, now

    def take(self) -> float:
        longest, self.longest = self.longest, 0.0
        return longest


async def clients(engine: Any, prompts: list[list[int]], stop: asyncio.Event) -> None:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)

    async def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            await engine.generate(f"c{i}-{n}", prompts[i % len(prompts)], params)
            n += 1

    async with asyncio.TaskGroup() as tg:
        for i in range(CLIENTS):
            tg.create_task(client(i))


def copy_alone(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> float:
    """Seconds to copy `weights` into `model`'s tensors in place (the transformers engine's swap by itself)."""
    targets = model.state_dict()
    started = time.perf_counter()
    with torch.no_grad():
        for name, tensor in weights.items():
            targets[name].copy_(tensor)
    return time.perf_counter() - started


async def measure(kind: str, model_dir: Path, rounds: int) -> dict[str, Any]:
    reference, tokenizer = load_model_and_tokenizer(model_dir)
    reference = reference.float()
    prompts = [tokenizer.encode(f"Write the number {i} in words, then count to ten.") for i in range(CLIENTS)]
    versions = [noisy(reference, seed) for seed in range(rounds + 1)]
    shared = False
    if kind == "vllm":
        from rollart.generation.vllm.engine import VLLMEngine

        engine: Any = VLLMEngine(model_dir, max_batch_size=CLIENTS, dtype="float32", cpu_threads_bind="1")
        shared = "shared" in inspect.signature(push_once).parameters  # receive into shared memory, as its node does
    else:
        from rollart.generation.hf.engine import HFEngine

        engine = HFEngine(model_dir, max_batch_size=CLIENTS, dtype=torch.float32)
    await engine.start()
    watch, stop = GapWatch(engine), asyncio.Event()
    quiet, pauses, blocks, calls, swaps, pushes = [], [], [], [], [], []
    try:
        async with asyncio.TaskGroup() as tg:
            watching = tg.create_task(watch.run())
            load = tg.create_task(clients(engine, prompts, stop))
            for version, weights in enumerate(versions, start=1):
                await asyncio.sleep(QUIET_S)
                quiet.append(watch.take())
                extra = {"shared": True} if shared else {}
                with capture_logs() as logs:
                    pushed = await push_once(engine.load_weights, version, weights, timeout=120, **extra)
                    # The transformers engine swaps at its next step; its public API has no event for it.
                    while engine.version < version:  # noqa: ASYNC110
                        await asyncio.sleep(POLL_S)
                pauses.append(watch.take())
                pushes.append(pushed.seconds)
                stopped, call, swap = engine_side(logs, kind)
                blocks.append(stopped)
                calls.append(call)
                swaps.append(swap if swap is not None else await asyncio.to_thread(copy_alone, reference, weights))
            stop.set()
            await load
            watching.cancel()
    finally:
        await engine.close()
    # The first round is the warm-up.
    quiet, pauses, blocks, calls, swaps, pushes = quiet[1:], pauses[1:], blocks[1:], calls[1:], swaps[1:], pushes[1:]
    swap = statistics.median(swaps)
    return {
        "engine": kind,
        "MB": sum(t.nbytes for t in versions[0].values()) / 1e6,
        "quiet_ms": 1000 * max(quiet),
        "gap_ms": 1000 * max(pauses) if kind == "vllm" else None,
        "blocked_ms": 1000 * max(blocks),
        "call_ms": None if None in calls else 1000 * max(c for c in calls if c is not None),
        "swap_ms": 1000 * swap,
        "push_ms": 1000 * statistics.median(pushes),
        "pause_over_swap": max(b / s for b, s in zip(blocks, swaps, strict=True)),
        "blocked_rounds_ms": [round(1000 * b, 1) for b in blocks],
    }


def engine_side(logs: list[dict[str, Any]], kind: str) -> tuple[float, float | None, float | None]:
    """From the engine's log of one push: the longest time it stopped decoding for it, timed where the work runs;
    the wall time of its longest weight call seen from this process (None: not logged), which also counts the wait
    for the step in progress to end; and the swap alone (None: timed here instead).

    vLLM runs each weight call between two steps: the staged route maps the version in one call (`worker_stage_s`)
    and reloads it in the next (`worker_swap_s`), each timed in the workers; before it, one call received the
    bytes and reloaded them (`receive_s` + `reload_s`). The swap alone is the workers' reload. The transformers
    engine stops for the copy it logs (`swap_s`)."""
    if kind == "hf":
        (event,) = [e for e in logs if e["event"] == "hf weights swapped"]
        return event["swap_s"], None, None
    (event,) = [e for e in logs if e["event"] == "vllm weights loaded"]
    if "worker_swap_s" in event:
        stop = max(event["worker_stage_s"], event["worker_swap_s"])
        return stop, max(event["mapped_s"], event["swap_s"]), event["worker_swap_s"]
    return event["receive_s"] + event["reload_s"], None, event["reload_s"]


def report(rows: list[dict[str, Any]], argv: list[str]) -> str:
    import transformers

    extra = f"transformers {transformers.__version__}"
    with contextlib.suppress(ImportError):
        import vllm  # type: ignore[import-not-found,unused-ignore]

        extra += f", vllm {vllm.__version__}"
    lines = [
        "# Decoding pause during a push, against the swap alone",
        "",
        f"{datetime.date.today()}; {describe(['torch'], extra=extra)}",
        "",
        f"Command: `PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/decode_pause.py {shlex.join(argv)}`",
        "",
        "| engine | version MB (fp32) | push, publish to ack (ms, median) | longest token gap, no push (ms) | longest "
        "token gap during a push (ms) | longest weight call, wall time here (ms) | longest stop of decoding for a "
        "push, timed in the engine (ms) | swap alone (ms, median) | stop / swap alone (the round's, largest) "
        "| stop per round (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        gap = "-" if r["gap_ms"] is None else f"{r['gap_ms']:.1f}"
        call = "-" if r["call_ms"] is None else f"{r['call_ms']:.1f}"
        lines.append(
            f"| {r['engine']} | {r['MB']:.0f} | {r['push_ms']:.0f} | {r['quiet_ms']:.1f} | {gap} | {call} "
            f"| {r['blocked_ms']:.1f} | {r['swap_ms']:.1f} | {r['pause_over_swap']:.2f} "
            f"| {', '.join(str(b) for b in r['blocked_rounds_ms'])} |"
        )
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace, argv: list[str]) -> None:
    torch.set_num_threads(1)  # the transformers engine's one thread, beside vLLM's worker on core 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollart-bench-") as folder:
        model_dir = build_qwen3_bpe_model(Path(folder) / "model", seed=0)
        for kind in args.engines:
            rows.append(await measure(kind, model_dir, args.rounds))
            print(rows[-1], file=sys.stderr, flush=True)
    text = report(rows, argv)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", nargs="+", choices=["vllm", "hf"], default=["vllm", "hf"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="the rows as JSON too (benchmarks/weight_sync.py)")
    asyncio.run(main(parser.parse_args(), sys.argv[1:]))
