"""`run.trainer`: how the trainer node trains (`TrainerSpec`), and where a trainer node's ranks sit in its group.

Part of the topology, so it imports no torch: the launcher, the CLI and `rollart check` read it without a
training engine. What depends on the backend (which backends there are, which split layers or train LoRA) is
the backend's record in `rollart.training.registry`, which checks a spec against it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rollart.algorithms.config import GRPOConfig
from rollart.lora.spec import LoraSpec
from rollart.weights.config import WeightsSpec

Precision = Literal["auto", "fp32", "bf16"]


class TrainerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How the trainer node trains (`run.trainer` in the topology)."""

    backend: str = "torch"
    """A key of `TRAINING_BACKENDS` (`rollart.training.registry`): torch (plain PyTorch on one device, CPU or
    GPU), fsdp2 (FSDP2 over rank processes) or megatron (Megatron-Core, GPU)."""
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
    the decoder once (`rollart.training.logprobs`). Exact; micro-batch sizes then count the distinct
    prefixes. False: every row its own pass."""
    mismatch_warn_kl: float = 0.02
    """Warn (`trainer.mismatch`, naming the generators) when a step's KL between the generators' and the trainer's
    log-probs on tokens of the trainer's own version (`mismatch_kl`) exceeds this: their weights or numerics
    differ (a weight sync gone wrong, a wrong name mapping, a dtype change). Healthy runs: about 1e-5 in fp32 on
    CPU; 0 turns the warning off."""
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
    weights: WeightsSpec = WeightsSpec()
    """How weights reach the generators (`run.trainer.weights`: transport, buckets, fan-out, deltas)."""
    threads: int = 0
    """torch intra-op threads on CPU; 0: torch's default."""

    def validate(self) -> list[tuple[str, str]]:
        """Problems with values whatever the backend (`rollart.training.registry.check` adds the backend's own)."""
        problems = [(f"grpo.{key}", problem) for key, problem in self.grpo.validate()]
        if self.lora is not None:
            problems += [(f"lora.{key}", problem) for key, problem in self.lora.validate()]
            if self.master_dtype != "fp32":
                problems.append(("master_dtype", "with lora the base is in lora.base_dtype: keep master_dtype fp32"))
        problems += [(f"weights.{key}", problem) for key, problem in self.weights.validate()]
        for key in ("lr", "ranks", "micro_batch_size", "updates_per_batch", "epochs", "rank_timeout_s"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        for key in (
            "weight_decay",
            "grad_clip",
            "checkpoint_every",
            "threads",
            "micro_batch_tokens",
            "logprob_chunk_tokens",
            "mismatch_warn_kl",
        ):
            if getattr(self, key) < 0:
                problems.append((key, f"must be >= 0, got {getattr(self, key)}"))
        for key in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, key) < 1:
                problems.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if self.keep_checkpoints < 1:
            problems.append(("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}"))
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
