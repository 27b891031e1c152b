"""The trainer node's side of an engine that trains in rank processes: what the fsdp2 and megatron engines share.

The engine owns its `RankGroup` (`rollart.training.ranks.group`) and rank 0 of it: a step sends the whole packed
batch down and gets the statistics back, an export gets the weights back bucket by bucket in Hugging Face names,
a checkpoint is written by the ranks (`save` returns once training may go on). Each backend adds how it loads a
checkpoint and what it says about itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.training.ranks.group import RankDied, RankGroup
from rollart.training.ranks.process import RankMain
from rollart.training.spec import RankLayout, TrainerSpec


class RankGroupEngine:
    """Drives this node's ranks; it owns rank 0, so it is the primary of its group."""

    backend = ""

    def __init__(
        self, model_path: str | Path, spec: TrainerSpec, *, seed: int, layout: RankLayout, entry: RankMain
    ) -> None:
        """Start this node's ranks at `entry`, the backend's rank process."""
        from transformers import AutoTokenizer

        self.spec = spec
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)
        self.ranks = RankGroup(spec, str(model_path), seed=seed, layout=layout, primary=True, entry=entry)
        try:
            self.info: dict[str, Any] = self.ranks.call("describe")  # every rank up and holding its shard
        except BaseException:
            self.ranks.close()
            raise

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        stats: dict[str, float] = self.ranks.call("train", batch.to("cpu"), version)
        return stats

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        parts: list[dict[str, torch.Tensor]] = []
        sent = self.ranks.call("export", self.spec.weights.bucket_bytes, dtype, on_part=parts.append)
        if len(parts) != sent:  # never publish part of a version
            raise RankDied(f"export: rank 0 sent {sent} parts of the weights and {len(parts)} arrived")
        return {name: tensor for part in parts for name, tensor in part.items()}

    def exports_copies(self, dtype: torch.dtype | None = None) -> bool:
        return True  # gathered from the ranks into this process

    def save(self, path: Path) -> Future[None]:
        written: Future[None] = Future()
        written.set_running_or_notify_cancel()  # a waiter that gives up must not cancel it under the group
        self.ranks.call("save", str(path), later=written)
        return written

    def close(self) -> None:
        self.ranks.close()

    def failed(self) -> Future[None]:
        return self.ranks.failed

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "backend": self.backend,
            "ranks": self.ranks.layout.world_size,
            "precision": spec.precision,
            "master_dtype": spec.master_dtype,
            "activation_checkpointing": spec.activation_checkpointing,
            "reference_model": spec.grpo.kl_coef > 0,
            "pids": [process.pid for process in self.ranks.processes.values()],
            **self.info,
        }
