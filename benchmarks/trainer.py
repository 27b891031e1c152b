"""Trainer benchmark: what FSDP2 sharding, activation checkpointing and chunked log-probs do to memory and speed.

Run from the repository root (about eight minutes; the rank processes need about 10 GB at the top):

    .venv/bin/python benchmarks/trainer.py            # writes benchmarks/results/trainer.md
    .venv/bin/python benchmarks/trainer.py --quick    # a short batch, one measured step: a smoke run
    .venv/bin/python benchmarks/trainer.py --out /tmp/trainer.md

The model is a Qwen3 built here from a seed (`rollart.tiny.model`, random weights, nothing
downloaded): Qwen3's vocabulary of 151,936, an output head of its own (untied), hidden 256, 8
layers, 84 M parameters, 93 % of them in the embeddings and the head. Every row trains it with
`backend: fsdp2` on CPU (gloo, one process per rank, `threads: 1` per rank so that 2 ranks fit the
2 cores), fp32 weights, AdamW, one micro-batch per rank per step of `ROWS` rows of `SEQ` tokens
each: 2 ranks train on a batch of twice the rows, so every rank in every row gets the same
micro-batch (rows of equal length split exactly). The rows: 1 and 2 ranks, activation
checkpointing off and on, log-probs chunked (`logprob_chunk_tokens`, the engine's default 1,024)
and full (0: the whole [rows, tokens, 151,936] logits at once); and one more at 1 rank with chunks
of 256, to see how a chunk's size sets the peak.

Each row starts its own engine, trains one warm-up step (AdamW's state is made in it), then
`--steps` measured steps on new batches of the same shape. Per rank, from the engine's statistics:
model-state bytes (parameters, gradients and AdamW state counted from the rank's own tensors) and
peak memory (the rank process's VmHWM over the step, reset at its start: everything it touched,
the Python and torch baseline included); the tables take the larger rank's. tokens/s is every
token the step trained on, all ranks (prompt and response, rows x `SEQ`), over the step's
`train_s`; medians over the measured steps. The report's reading is written from the numbers, and
its last line is the `summary:` of the issue (2 ranks over 1 per rank, chunked over full).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import describe  # noqa: E402 - benchmarks/machine.py

from rollart.algorithms.grpo import PackedBatch, pack_batch  # noqa: E402
from rollart.testkit.batches import Seq  # noqa: E402
from rollart.tiny.model import MARKER_FILE, TinySizes, build_tiny_model  # noqa: E402
from rollart.training.registry import build_training_engine  # noqa: E402
from rollart.training.spec import TrainerSpec  # noqa: E402

VOCAB = 151_936
SIZES = TinySizes(
    hidden_size=256,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=768,
    max_position_embeddings=4096,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
)
ROWS, SEQ, PROMPT, CHUNK, SMALL_CHUNK = 4, 512, 64, 1024, 256
"""Per rank: 4 rows of 512 tokens (64 prompt, 448 response); chunks of 1,024 positions (the
engine's default), and one row with chunks of 256."""
QUICK = (1, 256, 32, 128, 64)
MIB = 2**20
NOISE = 0.1
"""Step times on this shared 2-core machine move by about this much between runs."""
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "trainer.md"


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    """Per rank."""
    seq: int
    prompt: int
    chunk: int
    small_chunk: int

    def logits_mib(self, positions: int = 0) -> float:
        """fp32 logits of `positions` positions (0: a rank's whole micro-batch)."""
        return (positions or self.rows * self.seq) * VOCAB * 4 / MIB


@dataclasses.dataclass(frozen=True)
class Config:
    ranks: int
    checkpointing: bool
    chunk: int
    """logprob_chunk_tokens: 0, full logits."""

    def label(self) -> str:
        return f"{self.ranks} rank{'s' * (self.ranks > 1)}, act. ckpt {on_off(self.checkpointing)}, {self.logprobs()}"

    def logprobs(self) -> str:
        return f"chunks of {self.chunk:,}" if self.chunk else "full logits"


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


@dataclasses.dataclass(frozen=True)
class Row:
    config: Config
    state: list[float]
    """Per measured step: the larger rank's model-state bytes."""
    peak: list[float]
    """Per measured step: the larger rank's peak bytes."""
    seconds: list[float]
    tokens: int
    """Tokens one step trains on, all ranks."""

    def state_mib(self) -> float:
        return statistics.median(self.state) / MIB

    def peak_mib(self) -> float:
        return statistics.median(self.peak) / MIB

    def rest_mib(self) -> float:
        """Peak above model state: what sharding does not divide."""
        return self.peak_mib() - self.state_mib()

    def step_s(self) -> float:
        return statistics.median(self.seconds)

    def rate(self) -> float:
        return self.tokens / self.step_s()

    def rank_rate(self) -> float:
        return self.rate() / self.config.ranks


def equal_rows_batch(seed: int, rows: int, shape: Shape) -> PackedBatch:
    """`rows` rows of exactly `shape.seq` tokens, every response token a loss token; behaviour
    log-probs near log(1 / 151,936), so importance ratios stay near 1 as with real samples."""
    rng = random.Random(seed)
    response = shape.seq - shape.prompt
    seqs = [
        Seq(
            [rng.randint(5, VOCAB - 1) for _ in range(shape.prompt)],
            [rng.randint(5, VOCAB - 1) for _ in range(response)],
            [1] * response,
            [rng.uniform(-12.5, -11.5) for _ in range(response)],
            [1] * response,
        )
        for _ in range(rows)
    ]
    return pack_batch(seqs, [rng.uniform(-1, 1) for _ in seqs], pad_id=0)


def measure(model: Path, config: Config, shape: Shape, steps: int) -> Row:
    spec = TrainerSpec(
        backend="fsdp2",
        ranks=config.ranks,
        device="cpu",
        threads=1,
        micro_batch_size=shape.rows,
        activation_checkpointing=config.checkpointing,
        logprob_chunk_tokens=config.chunk,
    )
    print(f"{config.label()}: starting {config.ranks} rank process(es)", flush=True)
    engine = build_training_engine(spec, model, seed=0)
    state, peak, seconds = [], [], []
    try:
        for step in range(steps + 1):
            stats = engine.train_step(equal_rows_batch(step, shape.rows * config.ranks, shape), version=1)
            held = max(stats[f"state_bytes_r{r}"] for r in range(config.ranks))
            top = max(stats[f"peak_bytes_r{r}"] for r in range(config.ranks))
            kind = "warm-up" if step == 0 else f"step {step}/{steps}"
            print(
                f"  {kind}: {stats['train_s']:.1f} s, state {held / MIB:,.0f} MiB/rank, peak {top / MIB:,.0f} MiB/rank",
                flush=True,
            )
            if step > 0:
                state.append(held)
                peak.append(top)
                seconds.append(stats["train_s"])
    finally:
        engine.close()
    return Row(config, state, peak, seconds, tokens=shape.rows * config.ranks * shape.seq)


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| ranks | act. ckpt | log-probs | model state MiB/rank | peak MiB/rank | peak - state MiB/rank "
        "| step s | tokens/s (all ranks) | tokens/s per rank | peak MiB/rank, every step | step s, every step |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        c = row.config
        cells = [
            str(c.ranks),
            on_off(c.checkpointing),
            c.logprobs(),
            f"{row.state_mib():,.0f}",
            f"{row.peak_mib():,.0f}",
            f"{row.rest_mib():,.0f}",
            f"{row.step_s():.2f}",
            f"{row.rate():,.0f}",
            f"{row.rank_rate():,.0f}",
            ", ".join(f"{p / MIB:,.0f}" for p in row.peak),
            ", ".join(f"{s:.2f}" for s in row.seconds),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ratios(rows: list[Row], field: str, pairs: list[tuple[object, object]], title: str) -> list[str]:
    """A line per pair of rows that differ only in `field`: the row with the pair's first value
    over the one with its second."""
    by = {row.config: row for row in rows}
    lines = [
        f"| {title} | state/rank | peak/rank | peak - state, /rank | step s | tokens/s (all ranks) "
        "| tokens/s per rank |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for new, old in pairs:
        for row in rows:
            base = by.get(dataclasses.replace(row.config, **{field: old}))
            if getattr(row.config, field) != new or base is None:
                continue
            fixed = {
                "ranks": f"{row.config.ranks} rank{'s' * (row.config.ranks > 1)}",
                "checkpointing": f"act. ckpt {on_off(row.config.checkpointing)}",
                "chunk": row.config.logprobs(),
            }
            del fixed[field]
            if field == "chunk":
                fixed["chunk"] = f"chunks of {new}"
            cells = [
                ", ".join(fixed.values()),
                f"{row.state_mib() / base.state_mib():.2f}",
                f"{row.peak_mib() / base.peak_mib():.2f}",
                f"{row.rest_mib() / base.rest_mib():.2f}",
                f"{row.step_s() / base.step_s():.2f}",
                f"{row.rate() / base.rate():.2f}",
                f"{row.rank_rate() / base.rank_rate():.2f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(rows: list[Row], shape: Shape) -> str:
    """At the engine's defaults (chunked log-probs, no activation checkpointing): 2 ranks over 1;
    the chunked peak over the full one at 1 rank."""
    by = {row.config: row for row in rows}
    one, two, full = by[Config(1, False, shape.chunk)], by[Config(2, False, shape.chunk)], by[Config(1, False, 0)]
    return (
        f"summary: state_per_rank_2v1={two.state_mib() / one.state_mib():.2f} "
        f"peak_per_rank_2v1={two.peak_mib() / one.peak_mib():.2f} "
        f"chunked_logprob_mem_ratio={one.peak_mib() / full.peak_mib():.2f}"
    )


def bare_process_mib() -> float:
    """The resident peak of a process that has imported what a rank imports, before any model."""
    code = (
        "import re, torch, torch.distributed, transformers\n"
        "from transformers import Qwen3ForCausalLM\n"
        "import rollart.training.fsdp.rank\n"
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per row, after one warm-up step")
    parser.add_argument("--quick", action="store_true", help="1 row of 256 tokens per rank, 1 measured step")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    shape = Shape(*(QUICK if args.quick else (ROWS, SEQ, PROMPT, CHUNK, SMALL_CHUNK)))
    steps = 1 if args.quick else args.steps
    machine = describe(["torch", "transformers"])
    began = time.monotonic()
    configs = [Config(r, ckpt, chunk) for r in (1, 2) for ckpt in (False, True) for chunk in (shape.chunk, 0)]
    configs.insert(2, Config(1, False, shape.small_chunk))
    bare = bare_process_mib()
    print(f"a bare process with torch and transformers imported: {bare:,.0f} MiB resident", flush=True)
    with tempfile.TemporaryDirectory(prefix="rollart-trainer-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0, sizes=SIZES)
        params = int(json.loads((model / MARKER_FILE).read_text())["parameters"])
        print(f"built the model: {params:,} parameters, vocabulary {VOCAB:,}, untied head", flush=True)
        rows = [measure(model, config, shape, steps) for config in configs]
    took = time.monotonic() - began
    print("\n".join(table(rows)))
    print(summary(rows, shape))
    run = Run(rows, shape, steps, params, bare, machine, took)
    args.out.write_text(report(run))
    print(f"wrote {args.out}")


@dataclasses.dataclass(frozen=True)
class Run:
    rows: list[Row]
    shape: Shape
    steps: int
    params: int
    bare_mib: float
    """A bare process's resident peak (`bare_process_mib`)."""
    machine: str
    took_s: float

    def row(self, ranks: int, checkpointing: bool, chunk: int) -> Row:
        return next(row for row in self.rows if row.config == Config(ranks, checkpointing, chunk))


def report(run: Run) -> str:
    shape = run.shape
    scored = shape.rows * (shape.seq - 1)
    embeddings_mib = 2 * VOCAB * SIZES.hidden_size * 4 / MIB
    parts = [
        "# Trainer: FSDP2 sharding, activation checkpointing and chunked log-probs on CPU ranks",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root; took {run.took_s:.0f} s)",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- machine: {run.machine}; shared with other jobs throughout",
        f"- model: Qwen3 built from seed 0 (random weights), {run.params:,} parameters, vocabulary {VOCAB:,}, untied "
        f"head, hidden {SIZES.hidden_size}, {SIZES.num_layers} layers, {SIZES.num_heads} heads "
        f"({SIZES.num_kv_heads} KV), MLP {SIZES.intermediate_size}; fp32 weights and AdamW state",
        f"- per rank and step, in every row: one micro-batch of {shape.rows} row{'s' * (shape.rows > 1)} x "
        f"{shape.seq} tokens "
        f"({shape.prompt} prompt + {shape.seq - shape.prompt} response, all loss tokens; {scored:,} positions "
        f"scored); 2 ranks train on {2 * shape.rows} rows; `backend: fsdp2`, gloo, `threads: 1` per rank",
        f"- 1 warm-up step, then {run.steps} measured steps per row, medians; per rank: the larger of the ranks; "
        "model state = parameters + gradients + AdamW moments counted from the rank's tensors; peak = the rank "
        "process's VmHWM over the step (everything it touched, its Python and torch baseline included); "
        "tokens/s = all tokens trained on (rows x tokens, every rank) / the step's train_s",
        f"- sizes for the reading: fp32 logits of one rank's whole micro-batch {shape.logits_mib():,.0f} MiB, of "
        f"a chunk of {shape.chunk:,} positions {shape.logits_mib(shape.chunk):,.0f} MiB, of {shape.small_chunk:,} "
        f"{shape.logits_mib(shape.small_chunk):,.0f} MiB; embeddings + head {embeddings_mib:,.0f} MiB, all "
        f"parameters {run.params * 4 / MIB:,.0f} MiB; a bare process with torch and transformers imported "
        f"{run.bare_mib:,.0f} MiB resident",
        "",
        "## Every row",
        "",
        *table(run.rows),
        "",
        "## 2 ranks against 1 (per rank: the same micro-batch)",
        "",
        *ratios(run.rows, "ranks", [(2, 1)], "2 ranks / 1, at"),
        "",
        "## Activation checkpointing on against off",
        "",
        *ratios(run.rows, "checkpointing", [(True, False)], "on / off, at"),
        "",
        "## Chunked log-probs against full logits",
        "",
        *ratios(run.rows, "chunk", [(shape.chunk, 0), (shape.small_chunk, 0)], "chunked / full, at"),
        "",
        "## Reading",
        "",
        *reading(run),
        "The summary takes the engine's defaults (chunked log-probs, no activation checkpointing) for "
        "the two 2-vs-1 ratios, and 1 rank without activation checkpointing for the chunked one.",
        "",
        summary(run.rows, shape),
        "",
    ]
    return "\n".join(parts)


def spread(rows: Iterable[list[float]]) -> float:
    """The largest (max - min) / median of a row's measured steps."""
    return max((max(steps) - min(steps)) / statistics.median(steps) for steps in rows)


def noise(*ratios: float) -> str:
    """Which time ratios lie beyond what this shared machine moves step times by (`NOISE`)."""
    beyond = [f"{ratio:.2f}x" for ratio in ratios if abs(ratio - 1) >= NOISE]
    if not beyond:
        return f"(within the {NOISE:.0%} this machine's step times move by)"
    return f"({' and '.join(beyond)} beyond the {NOISE:.0%} this machine's step times move by)"


def reading(run: Run) -> list[str]:
    """What the numbers say, written from them: a paragraph per comparison."""
    shape = run.shape
    one, two = run.row(1, False, shape.chunk), run.row(2, False, shape.chunk)
    ckpt_one, ckpt_two = run.row(1, True, shape.chunk), run.row(2, True, shape.chunk)
    full, small = run.row(1, False, 0), run.row(1, False, shape.small_chunk)
    two_full = run.row(2, False, 0)
    full_2v1 = two_full.rank_rate() / full.rank_rate()
    full_note = ""
    if full_2v1 < two.rank_rate() / one.rank_rate() - NOISE:
        full_note = (
            ", less: perhaps two processes each streaming GBs of logits through one memory bus (this "
            "benchmark does not isolate it)"
        )
    decoder = 1 - 2 * VOCAB * SIZES.hidden_size / run.params
    scored = shape.rows * (shape.seq - 1)
    extra = two.rest_mib() - one.rest_mib()
    # The head's share of the peak, from the two chunk sizes: what one chunk-sized tensor more costs.
    per_chunk = (one.peak_mib() - small.peak_mib()) / (
        shape.logits_mib(shape.chunk) - shape.logits_mib(shape.small_chunk)
    )
    head_chunked = per_chunk * shape.logits_mib(shape.chunk)
    per_full = (head_chunked + full.peak_mib() - one.peak_mib()) / shape.logits_mib()
    paragraphs = [
        f"**Sharding.** Model state per rank halves ({one.state_mib():,.0f} -> {two.state_mib():,.0f} MiB, "
        f"{two.state_mib() / one.state_mib():.2f}): FSDP2 splits every parameter, its gradient and both AdamW "
        f"moments (16 bytes a parameter) between the ranks. Peak memory per rank falls much less, to "
        f"{two.peak_mib() / one.peak_mib():.2f} of one rank's ({one.peak_mib():,.0f} -> {two.peak_mib():,.0f} "
        f"MiB), because the state is the smaller part of it ({one.state_mib() / one.peak_mib():.0%} of one "
        f"rank's peak): what lies above it, {one.rest_mib():,.0f} MiB at 1 rank and {two.rest_mib():,.0f} MiB "
        "at 2, is per micro-batch or per process, and sharding divides none of it. At a vocabulary of "
        f"151,936 the output head dominates it: a rank's micro-batch has {shape.logits_mib():,.0f} MiB of fp32 "
        f"logits, a chunk of {shape.chunk:,} positions {shape.logits_mib(shape.chunk):,.0f} MiB, and the head's "
        f"backward pass holds several tensors of that size at once (about {per_chunk:.0f} a chunk: see chunked "
        f"log-probs below). Then the process itself ({run.bare_mib:,.0f} MiB resident with torch and transformers "
        f"imported, before any model), and the embeddings and head gathered whole for the step "
        f"({2 * VOCAB * SIZES.hidden_size * 4 / MIB:,.0f} MiB) with their whole gradients until the "
        f"reduce-scatter. 2 ranks hold {abs(extra):,.0f} MiB {'more' if extra > 0 else 'less'} above the state "
        "than 1: what real collectives add (at 1 rank FSDP2 copies the shard straight into the whole "
        "parameter; at 2 it goes through the all-gather's input and output buffers as well). "
        "Sharding pays where state dominates (a 7 B "
        "model in fp32 with AdamW has 112 GB of it); at 84 M parameters against 151,936-wide logits, the "
        "peak ratio cannot come near the state ratio.",
        f"**Speed.** Two ranks, one core each, train {two.rate() / one.rate():.2f}x the tokens per second of "
        f"one ({one.rate():,.0f} -> {two.rate():,.0f} tokens/s at the defaults), "
        f"{two.rank_rate() / one.rank_rate():.2f}x per rank: a step of 2 ranks took "
        f"{two.step_s() / one.step_s():.2f}x as long as a step of one rank "
        "doing the same per-rank work. The difference is the collectives (gloo, through the host: every step "
        f"all-gathers the parameters, {run.params * 4 / MIB:,.0f} MiB whole, the decoder layers again in the "
        "backward pass, and reduce-scatters the gradients) and the cores: one rank leaves the second core to "
        "the rest of the machine, two ranks share both with it, and other jobs ran throughout. With full "
        f"logits 2 ranks make {full_2v1:.2f}x per rank{full_note}. "
        f"Within a row, step times moved by up to {spread(r.seconds for r in run.rows):.0%} from step to step "
        f"and peaks by up to {spread(r.peak for r in run.rows):.0%}.",
        f"**Activation checkpointing** takes peak per rank from {one.peak_mib():,.0f} to "
        f"{ckpt_one.peak_mib():,.0f} MiB at 1 rank ({ckpt_one.peak_mib() / one.peak_mib():.2f}) and from "
        f"{two.peak_mib():,.0f} to {ckpt_two.peak_mib():,.0f} MiB at 2 ({ckpt_two.peak_mib() / two.peak_mib():.2f}): "
        f"the {SIZES.num_layers} decoder layers keep only their inputs instead of all their activations. Its "
        f"cost, one more forward pass of the decoder, is small here, since the decoder holds {decoder:.0%} of "
        "the parameters and the head, which it does not recompute, does most of a step's work: step time "
        f"{ckpt_one.step_s() / one.step_s():.2f}x and {ckpt_two.step_s() / two.step_s():.2f}x "
        f"{noise(ckpt_one.step_s() / one.step_s(), ckpt_two.step_s() / two.step_s())}. With a vocabulary this "
        "wide and a model this small, the logits set the peak, not the decoder's activations.",
        f"**Chunked log-probs** with chunks of {shape.chunk:,} positions (the engine's default) take one rank's "
        f"peak from {full.peak_mib():,.0f} to {one.peak_mib():,.0f} MiB ({one.peak_mib() / full.peak_mib():.2f}), "
        f"chunks of {shape.small_chunk:,} to {small.peak_mib():,.0f} MiB ({small.peak_mib() / full.peak_mib():.2f}). "
        f"From chunks of {shape.small_chunk:,} to {shape.chunk:,} the peak grows by "
        f"{one.peak_mib() - small.peak_mib():,.0f} MiB, {per_chunk:.1f} times the growth of one chunk's logits "
        f"({shape.logits_mib(shape.small_chunk):,.0f} -> {shape.logits_mib(shape.chunk):,.0f} MiB): a chunk's "
        f"backward pass holds about {per_chunk:.0f} chunk-sized fp32 tensors at once (the logits recomputed, "
        "their exponentials, the gradients). Counted the same way, the full path holds about "
        f"{per_full:.1f} times the whole logits. So a chunk has to be a small part of the micro-batch to pay: "
        f"this micro-batch scores {scored:,} positions, a chunk of {shape.chunk:,} is "
        f"{min(shape.chunk / scored, 1):.0%} of them and saves {1 - one.peak_mib() / full.peak_mib():.0%} of "
        "the peak. On a GPU, with micro-batches of many thousand tokens, a chunk of 1,024 is a small part, and "
        "the full logits alone may not fit. Step time, chunked over full: "
        f"{one.step_s() / full.step_s():.2f}x with chunks of {shape.chunk:,}, "
        f"{small.step_s() / full.step_s():.2f}x with {shape.small_chunk:,} "
        f"{noise(one.step_s() / full.step_s(), small.step_s() / full.step_s())}; chunking recomputes the head "
        "in the backward pass, against writing and reading the whole logits without it.",
    ]
    return [line for paragraph in paragraphs for line in (paragraph, "")]


if __name__ == "__main__":
    main()
