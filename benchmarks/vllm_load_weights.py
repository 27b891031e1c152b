"""How long `VLLMEngine.load_weights` takes: a new version into a running vLLM engine, idle, per model size.

Run from the repository root with the vLLM environment (each size starts an engine: ~20-50 s on 2 cores):

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_load_weights.py            # prints the table
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_load_weights.py --rounds 3 --sizes tiny
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_load_weights.py --out benchmarks/results/vllm_load_weights.md

Per size a model is built into a temp folder (`rollart.tiny.model.build_tiny_model`), an engine starts on it
(fp32, eager), and each round hands it the model's state dict plus seeded noise as the next version, the way a
`WeightReceiver` does: HF names, the tied `lm_head.weight` included as the same tensor as the embeddings. A round
is the whole `load_weights` call (checks, staging, vLLM's reload, relabel, prefix-cache reset); where the engine
logs its split (the staged route does), the median of the staging (copy into shared memory while the engine keeps
decoding) and of the workers' swap (vLLM's reload: the only part that pauses decoding) is given too.
One warm-up round, then `--rounds`; the table gives the median, the fastest and the slowest. The script uses the
engine's public API only, so the same command measures any version of the engine: with PYTHONPATH at a checkout
of another commit it measures that commit's engine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import describe  # benchmarks/machine.py: this folder is on sys.path when run as a script
from structlog.testing import capture_logs

from rollart.generation.vllm.engine import VLLMEngine
from rollart.tiny.model import TinySizes, build_tiny_model

SIZES = {
    "tiny": TinySizes(),
    "mid": TinySizes(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536, vocab_size=32768
    ),
}
"""tiny: the default run's model (~1 M parameters, 4 MB fp32); mid: ~42 M parameters (168 MB fp32)."""


def noisy_state_dict(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    noisy = {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}
    noisy.setdefault("lm_head.weight", noisy["model.embed_tokens.weight"])  # tied: both names, one tensor
    return noisy


async def measure(name: str, sizes: TinySizes, rounds: int, folder: Path) -> dict[str, object]:
    model_dir = build_tiny_model(folder / name, seed=0, sizes=sizes)
    versions = [noisy_state_dict(model_dir, seed) for seed in range(rounds + 1)]
    nbytes = sum(t.nbytes for n, t in versions[0].items() if n != "lm_head.weight")
    engine = VLLMEngine(model_dir, max_batch_size=8)
    await engine.start()
    seconds, parts = [], []
    try:
        for version, weights in enumerate(versions, start=1):
            with capture_logs() as logs:
                started = time.perf_counter()
                await engine.load_weights(version, weights)
                seconds.append(time.perf_counter() - started)
            parts += [e for e in logs if e["event"] == "vllm weights loaded" and "staged_s" in e][-1:]
    finally:
        await engine.close()
    timed, split = seconds[1:], parts[1:]  # the first is the warm-up
    return {
        "size": name,
        "MB": nbytes / 1e6,
        "median_ms": 1000 * statistics.median(timed),
        "min_ms": 1000 * min(timed),
        "max_ms": 1000 * max(timed),
        # The engine's own split, where it logs one: staging, and the workers' swap (vLLM's reload).
        "staged_ms": f"{1000 * statistics.median(e['staged_s'] for e in split):.0f}" if split else "-",
        "swap_ms": f"{1000 * statistics.median(e['worker_swap_s'] for e in split):.0f}" if split else "-",
        "rounds": [round(1000 * s, 1) for s in timed],
    }


def vllm_version() -> str:
    import vllm  # type: ignore[import-not-found,unused-ignore]

    return str(vllm.__version__)


def report(rows: list[dict[str, object]], argv: list[str]) -> str:
    lines = [
        "# `VLLMEngine.load_weights`: a new version into a running, idle engine",
        "",
        f"{datetime.date.today()}; {describe(['torch'], extra=f'vllm {vllm_version()}')}",
        "",
        f"Command: `PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_load_weights.py {shlex.join(argv)}`",
        "",
        "| size | fp32 MB | median ms | min ms | max ms | of which staging / swap ms | rounds (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size']} | {row['MB']:.1f} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | {row['max_ms']:.1f} "
            f"| {row['staged_ms']} / {row['swap_ms']} | {', '.join(str(r) for r in row['rounds'])} |"  # type: ignore[attr-defined]
        )
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace, argv: list[str]) -> None:
    torch.set_num_threads(1)  # the engine's processes need the cores
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollart-bench-") as folder:
        for name in args.sizes:
            rows.append(await measure(name, SIZES[name], args.rounds, Path(folder)))
            print(rows[-1], file=sys.stderr, flush=True)
    text = report(rows, argv)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "mid"])
    parser.add_argument("--out", type=Path, default=None)
    asyncio.run(main(parser.parse_args(), sys.argv[1:]))
