"""The FSDP2 training engine (`run.trainer.backend: fsdp2`): the trainer node's side of its ranks.

The node stays one asyncio daemon; this engine starts its rank processes (`RankGroup`, one per
device: gloo on CPU, NCCL on GPU) and drives them. Each step the whole packed batch goes to rank 0,
which broadcasts it; every rank trains on its token-balanced share (`rollart.engines.step`), and
the statistics come back summed over ranks, with each rank's model-state and peak bytes
(`state_bytes_rN`, `peak_bytes_rN`). Weights come back bucket by bucket in Hugging Face names, each
tensor gathered whole only while its bucket is on the way.

Checkpoints are `torch.distributed.checkpoint` shards (`dcp/`), beside the model's config and
tokenizer: `save` returns as soon as the shards are staged in memory, the write goes on in the
background, and its future completes when the folder is whole. They load onto any number of ranks;
`rollart export` turns one into a Hugging Face model folder (`rollart.engines.export`).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.engines.export import DCP_FOLDER
from rollart.engines.fsdp_group import RankGroup
from rollart.engines.training import RankLayout, TrainerSpec
from rollart.errors import RollartError


class FSDPTrainer:
    """Drives this node's FSDP2 ranks (module docstring); it owns rank 0, so it is the primary."""

    def __init__(self, model_path: str | Path, spec: TrainerSpec, *, seed: int, layout: RankLayout) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)
        self.ranks = RankGroup(spec, str(model_path), seed=seed, layout=layout, primary=True)
        try:
            self.info: dict[str, Any] = self.ranks.call("describe")  # every rank up and sharded
        except BaseException:
            self.ranks.close()
            raise

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        stats: dict[str, float] = self.ranks.call("train", batch.to("cpu"), version)
        return stats

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = {}
        self.ranks.call("export", self.spec.bucket_mb << 20, dtype, on_part=weights.update)
        return weights

    def exports_copies(self, dtype: torch.dtype | None = None) -> bool:
        return True  # gathered from the ranks into this process

    def full_state(self) -> dict[str, Any]:
        """Weights and optimizer state, whole, by parameter name (the rank group's `full_state`)."""
        state: dict[str, Any] = self.ranks.call("full_state")
        return state

    def save(self, path: Path) -> Future[None]:
        written: Future[None] = Future()
        written.set_running_or_notify_cancel()  # a waiter that gives up must not cancel it under the group
        self.ranks.call("save", str(path), later=written)
        return written

    def load(self, path: Path) -> None:
        if not (path / DCP_FOLDER).is_dir():
            raise RollartError(
                f"{path} holds no {DCP_FOLDER}/ shards: it was not written by the fsdp2 backend (the torch "
                "backend writes a Hugging Face folder); resume with the backend that wrote it, or start a "
                "new run from it with `rollart export` and run.model.path"
            )
        self.ranks.call("load", str(path))

    def close(self) -> None:
        self.ranks.close()

    def failed(self) -> Future[None]:
        return self.ranks.failed

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "backend": "fsdp2",
            "ranks": self.ranks.layout.world_size,
            "precision": spec.precision,
            "master_dtype": spec.master_dtype,
            "activation_checkpointing": spec.activation_checkpointing,
            "reference_model": spec.grpo.kl_coef > 0,
            "pids": [process.pid for process in self.ranks.processes.values()],
            **self.info,
        }
