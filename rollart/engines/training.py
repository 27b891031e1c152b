"""The training engine interface every backend implements, its settings, and the factory that builds one.

A training engine owns the policy's trainable weights and optimizer. The trainer node hands it
one packed batch per step (`rollart.algorithms.grpo.PackedBatch`, advantages already computed);
the engine runs the GRPO loss over micro-batches, takes the optimizer step(s), and reports what
happened. Weights leave it by Hugging Face name (`export_weights`), which is what generators load,
whatever the engine's own layout (Megatron shards and fuses them; it must un-fuse here).

All methods block: the node calls them in a worker thread so its event loop keeps serving.

`TrainerSpec` (`run.trainer` in the topology) lives here, beside the engine it configures; it and
this module import no torch, so the topology loads without it. `build_training_engine` picks the
backend by `run.trainer.backend`: adding one (fsdp2, megatron) is a builder function at the end of
this module and its line in `TRAINING_BACKENDS`; the builder imports its backend (and torch) only
when chosen, and mypy checks that what it returns is a `TrainingEngine`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from rollart.algorithms.config import GRPOConfig
from rollart.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from rollart.algorithms.grpo import PackedBatch

Precision = Literal["auto", "fp32", "bf16"]


class LoraSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """LoRA adapters (`run.trainer.lora`): the base model frozen, only the adapters trained and pushed."""

    rank: int = 8
    """r: the adapters' inner dimension."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0: none; the generators never apply it)."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (PEFT's `target_modules`: the last part of a module's name)."""
    base_dtype: Literal["fp32", "bf16"] = "fp32"
    """The frozen base weights' dtype in the trainer (bf16: half the memory; the adapters stay fp32)."""

    @property
    def scaling(self) -> float:
        """What the adapter's B @ A is multiplied by before it is added to the base weight."""
        return self.alpha / self.rank

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.rank < 1:
            problems.append(("rank", f"must be >= 1, got {self.rank}"))
        if self.alpha <= 0:
            problems.append(("alpha", f"must be > 0, got {self.alpha}"))
        if not 0 <= self.dropout < 1:
            problems.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        if not self.target_modules:
            problems.append(("target_modules", "expected at least one module name, e.g. q_proj"))
        return problems


class TrainerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How the trainer node trains (`run.trainer` in the topology)."""

    backend: str = "torch"
    """A key of `TRAINING_BACKENDS`; torch: plain PyTorch on one device (CPU or GPU)."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    precision: Precision = "auto"
    """auto: bf16 autocast on GPUs that support it, fp32 on CPU (bf16 matmuls are slow there)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    ranks: int = 1
    """Training processes per trainer node, one per device (fsdp2, megatron; torch: 1). A group of
    trainer nodes (`primary:` in the topology) runs ranks x nodes in all."""
    tensor_parallel: int = 1
    """megatron: ranks each layer's matrices are split over; the group's ranks are tensor x pipeline x
    data parallel, data parallel being what is left."""
    pipeline_parallel: int = 1
    """megatron: stages the layers are split into, in order."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over a batch's micro-batches."""
    micro_batch_tokens: int = 0
    """When > 0, micro-batches by token budget instead: as many sequences as fit in this many
    padded tokens (sequences x the longest), longest first; micro_batch_size is then not used."""
    share_reads: bool = True
    """Rows whose log-probs need the same tokens (the same prefix up to the last generated token:
    every turn from the same board under `context: last`, a group's identical answers) go through
    the decoder once (`rollart.engines.logprobs`). Exact; micro-batch sizes then count the distinct
    prefixes. False: every row its own pass."""
    logprob_chunk_tokens: int = 1024
    """Apply the output head to this many positions at a time, recomputed in the backward pass, so
    the whole [N, T, vocabulary] logits never exist; 0: all at once."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    """Weights and optimizer state: fp32 (bf16 only in compute, with precision bf16), or pure bf16."""
    rank_timeout_s: float = 600.0
    """A collective that waits this long for another rank fails the step (fsdp2)."""
    updates_per_batch: int = 1
    """Optimizer steps per pass over a batch, each on 1/updates_per_batch of it (PPO mini-batches)."""
    epochs: int = 1
    """Passes over each batch (PPO epochs): epochs x updates_per_batch optimizer steps per training
    step, all in the trust region around the weights at the step's start. More than 1 gets more
    out of every trajectory when the trainer is faster than the generators."""
    grpo: GRPOConfig = GRPOConfig()
    lora: LoraSpec | None = None
    """Train LoRA adapters on a frozen base instead of every weight (torch and fsdp2 backends); the weight push
    then carries the adapters alone. None: full fine-tuning."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (and on drain); 0: only on drain."""
    keep_checkpoints: int = 2
    weight_transport: Literal["auto", "tcp", "ucx"] = "auto"
    """How weights reach generators: ucx when ucxx is installed (auto), else our TCP bulk path."""
    bucket_mb: int = 64
    """Weight-push bucket size."""
    weight_fanout: Literal["star", "relay"] = "relay"
    """How a version reaches the generators: relay (the trainer sends it once, to the head of a chain
    of generators ordered by cluster and host, and each forwards every bucket to the next as it
    arrives: the trainer's egress is one state dict) or star (the trainer sends it to each)."""
    weight_delta: bool = False
    """Send a generator that holds the version before the latest only what changed (each bucket's
    bytes XOR the previous version's, byte-shuffled and zstd-compressed, where that is smaller):
    for links slower than ~0.5 GiB/s, where the bytes saved outweigh the encoding. Each generator
    then keeps the bytes of its last version (one more copy of the weights in its memory)."""
    push_timeout_s: float | None = None
    """Seconds a push may take before it counts as failed and is retried; None: scaled with its bytes
    (30 s plus four times the transfer at the slowest rate measured so far)."""
    threads: int = 0
    """torch intra-op threads on CPU; 0: torch's default."""

    def validate(self) -> list[tuple[str, str]]:
        problems = [(f"grpo.{key}", problem) for key, problem in self.grpo.validate()]
        if self.lora is not None:
            problems += [(f"lora.{key}", problem) for key, problem in self.lora.validate()]
            if self.backend not in ("torch", "fsdp2"):
                problems.append(("lora", f"LoRA trains on the torch and fsdp2 backends; backend is {self.backend}"))
            if self.master_dtype != "fp32":
                problems.append(("master_dtype", "with lora the base is in lora.base_dtype: keep master_dtype fp32"))
        if self.backend not in TRAINING_BACKENDS:
            problems.append(("backend", unknown_backend(self.backend)))
        for key in ("lr", "ranks", "micro_batch_size", "updates_per_batch", "epochs", "bucket_mb", "rank_timeout_s"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        for key in (
            "weight_decay",
            "grad_clip",
            "checkpoint_every",
            "threads",
            "micro_batch_tokens",
            "logprob_chunk_tokens",
        ):
            if getattr(self, key) < 0:
                problems.append((key, f"must be >= 0, got {getattr(self, key)}"))
        for key in ("tensor_parallel", "pipeline_parallel"):
            value = getattr(self, key)
            if value < 1:
                problems.append((key, f"must be >= 1, got {value}"))
            elif value > 1 and self.backend != "megatron":
                problems.append((key, f"only the megatron backend splits layers; backend is {self.backend}"))
        if self.backend == "megatron" and self.tensor_parallel >= 1 and self.ranks % self.tensor_parallel:
            # Megatron keeps a tensor-parallel group on one node (its all-reduces run in every layer)
            problems.append(
                ("tensor_parallel", f"{self.tensor_parallel} must divide run.trainer.ranks ({self.ranks}, per node)")
            )
        if self.ranks > 1 and self.backend == "torch":
            problems.append(("ranks", f"the torch backend trains on one device; use backend fsdp2 for {self.ranks}"))
        if self.keep_checkpoints < 1:
            problems.append(("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}"))
        if self.push_timeout_s is not None and self.push_timeout_s <= 0:
            problems.append(
                ("push_timeout_s", f"must be > 0 (or null: scaled with the bytes), got {self.push_timeout_s}")
            )
        return problems


class RankLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where a trainer node's ranks sit in its group (`Topology.rank_layout`)."""

    world_size: int = 1
    """Ranks in the whole group."""
    first_rank: int = 0
    """This node's first rank; 0 on the primary."""
    local_ranks: int = 1
    """Ranks this node runs."""
    store_host: str = "127.0.0.1"
    """Where the primary serves the rendezvous store."""
    store_port: int = 0
    """Its port; 0: any free one (every rank on the primary's host)."""


class TrainingEngine(Protocol):
    """What the trainer node drives."""

    pad_id: int
    """The tokenizer's padding id, which `pack_batch` pads with."""

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        """One training step on a batch (its optimizer step(s) included); returns its statistics:
        at least `loss`, `grad_norm` and the off-policy measures of `LossStats.means`."""

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The current weights by Hugging Face name, cast to `dtype` (None: as trained). The tensors
        may alias the live parameters: copy them before the next `train_step`."""

    def exports_copies(self, dtype: torch.dtype | None = None) -> bool:
        """Whether `export_weights(dtype)` gives tensors nothing else holds (a cast, a gather), which
        the weight push may then send from their own memory instead of copying them first."""

    def save(self, path: Path) -> Future[None]:
        """Start a checkpoint of weights and optimizer state into `path` (a folder that does not
        exist yet). Returns once training may go on; the future completes when `path` is whole
        (a backend that writes in the background keeps writing meanwhile)."""

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (a backend with ranks: onto however many ranks it has now)."""

    def close(self) -> None:
        """Stop what the engine started (rank processes); it is not used afterwards."""

    def failed(self) -> Future[None] | None:
        """A future that fails once the engine cannot train any more though no call was under way
        (one of its rank processes died), so the node fails then rather than at its next call;
        None for an engine that nothing outside a call can break. It never completes otherwise."""

    def describe(self) -> dict[str, Any]:
        """What the engine runs on (backend, device, precision, parameters), for the start-up log."""


def build_training_engine(
    spec: TrainerSpec, model_path: str | Path, *, seed: int, layout: RankLayout | None = None
) -> TrainingEngine:
    """The training engine `spec.backend` names, on the model at `model_path`, with its ranks placed
    by `layout` (None: `spec.ranks` ranks on this node alone); blocks while it loads (call it in a
    worker thread). Raises ConfigError naming `run.trainer.backend` for an unknown one."""
    build = TRAINING_BACKENDS.get(spec.backend)
    if build is None:
        raise ConfigError(f"run.trainer.backend: {unknown_backend(spec.backend)}")
    return build(spec, model_path, seed, layout or RankLayout(world_size=spec.ranks, local_ranks=spec.ranks))


def unknown_backend(name: str) -> str:
    hint = difflib.get_close_matches(name, TRAINING_BACKENDS, n=1)
    known = ", ".join(sorted(TRAINING_BACKENDS))
    return f"unknown training backend {name!r} (known: {known})" + (f"; did you mean {hint[0]!r}?" if hint else "")


# -- the backends -------------------------------------------------------------------------------


def _torch(spec: TrainerSpec, model_path: str | Path, seed: int, layout: RankLayout) -> TrainingEngine:
    from rollart.engines.torch_train import TorchTrainer

    if layout.world_size != 1:
        raise ConfigError(f"run.trainer.backend: torch trains on one device, not {layout.world_size} ranks")
    return TorchTrainer(model_path, spec, seed=seed)


def _fsdp2(spec: TrainerSpec, model_path: str | Path, seed: int, layout: RankLayout) -> TrainingEngine:
    from rollart.engines.fsdp import FSDPTrainer

    return FSDPTrainer(model_path, spec, seed=seed, layout=layout)


def _megatron(spec: TrainerSpec, model_path: str | Path, seed: int, layout: RankLayout) -> TrainingEngine:
    from rollart.engines.megatron import MegatronTrainer

    return MegatronTrainer(model_path, spec, seed=seed, layout=layout)


TRAINING_BACKENDS: dict[str, Callable[[TrainerSpec, str | Path, int, RankLayout], TrainingEngine]] = {
    "torch": _torch,
    "fsdp2": _fsdp2,
    "megatron": _megatron,
}
"""`run.trainer.backend` -> the function that builds its engine (spec, model path, seed, rank layout)."""
