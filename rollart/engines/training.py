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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from rollart.algorithms.config import GRPOConfig
from rollart.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from rollart.algorithms.grpo import PackedBatch

Precision = Literal["auto", "fp32", "bf16"]


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
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over a batch's micro-batches."""
    updates_per_batch: int = 1
    """Optimizer steps per pass over a batch, each on 1/updates_per_batch of it (PPO mini-batches)."""
    epochs: int = 1
    """Passes over each batch (PPO epochs): epochs x updates_per_batch optimizer steps per training
    step, all in the trust region around the weights at the step's start. More than 1 gets more
    out of every trajectory when the trainer is faster than the generators."""
    grpo: GRPOConfig = GRPOConfig()
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (and on drain); 0: only on drain."""
    keep_checkpoints: int = 2
    weight_transport: Literal["auto", "tcp", "ucx"] = "auto"
    """How weights reach generators: ucx when ucxx is installed (auto), else our TCP bulk path."""
    bucket_mb: int = 64
    """Weight-push bucket size."""
    threads: int = 0
    """torch intra-op threads on CPU; 0: torch's default."""

    def validate(self) -> list[tuple[str, str]]:
        problems = [(f"grpo.{key}", problem) for key, problem in self.grpo.validate()]
        if self.backend not in TRAINING_BACKENDS:
            problems.append(("backend", unknown_backend(self.backend)))
        for key in ("lr", "micro_batch_size", "updates_per_batch", "epochs", "bucket_mb"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        for key in ("weight_decay", "grad_clip", "checkpoint_every", "threads"):
            if getattr(self, key) < 0:
                problems.append((key, f"must be >= 0, got {getattr(self, key)}"))
        if self.keep_checkpoints < 1:
            problems.append(("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}"))
        return problems


class TrainingEngine(Protocol):
    """What the trainer node drives."""

    pad_id: int
    """The tokenizer's padding id, which `pack_batch` pads with."""

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        """One training step on a batch (its optimizer step(s) included); returns its statistics:
        at least `loss`, `grad_norm` and the off-policy measures of `LossStats.means`."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The current weights by Hugging Face name. The tensors may alias the live parameters:
        copy them before the next `train_step`."""

    def save(self, path: Path) -> None:
        """Write weights (a loadable Hugging Face folder) and optimizer state into `path`."""

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""

    def describe(self) -> dict[str, Any]:
        """What the engine runs on (backend, device, precision, parameters), for the start-up log."""


def build_training_engine(spec: TrainerSpec, model_path: str | Path, *, seed: int) -> TrainingEngine:
    """The training engine `spec.backend` names, on the model at `model_path`; blocks while it loads
    (call it in a worker thread). Raises ConfigError naming `run.trainer.backend` for an unknown one."""
    build = TRAINING_BACKENDS.get(spec.backend)
    if build is None:
        raise ConfigError(f"run.trainer.backend: {unknown_backend(spec.backend)}")
    return build(spec, model_path, seed)


def unknown_backend(name: str) -> str:
    hint = difflib.get_close_matches(name, TRAINING_BACKENDS, n=1)
    known = ", ".join(sorted(TRAINING_BACKENDS))
    return f"unknown training backend {name!r} (known: {known})" + (f"; did you mean {hint[0]!r}?" if hint else "")


# -- the backends -------------------------------------------------------------------------------


def _torch(spec: TrainerSpec, model_path: str | Path, seed: int) -> TrainingEngine:
    from rollart.engines.torch_train import TorchTrainer

    return TorchTrainer(model_path, spec, seed=seed)


TRAINING_BACKENDS: dict[str, Callable[[TrainerSpec, str | Path, int], TrainingEngine]] = {
    "torch": _torch,
}
"""`run.trainer.backend` -> the function that builds its engine (spec, model path, seed)."""
