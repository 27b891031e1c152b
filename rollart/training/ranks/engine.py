"""The trainer node's side of an engine that trains in rank processes: what the fsdp2 and megatron engines share.

The engine owns its `RankGroup` (`rollart.training.ranks.group`) and rank 0 of it: a step sends the whole packed
batch down and gets the statistics back; an export hands rank 0 a shared-memory buffer of this node's, which it
fills in Hugging Face names (`rollart.training.ranks.export`), and is ordered before the next step without waiting
for it (`begin_export`); a checkpoint is written by the ranks (`save` returns once training may go on). Each
backend adds how it loads a checkpoint and what it says about itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.shm import locate
from rollart.training.ranks.export import ExportTarget, Placed, placed_tensors
from rollart.training.ranks.group import RankGroup
from rollart.training.ranks.process import RankMain
from rollart.training.spec import RankLayout, TrainerSpec
from rollart.weights.pool import BufferPool

_EXPORTS_KEPT = 2
"""Export buffers kept idle beyond the one in use: a version being pushed and the one before it."""


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
        self._exports = BufferPool(shared=True)
        """Where rank 0 writes exports: shared memory, each buffer reused once no exported tensor views it."""
        self._export_bytes: dict[torch.dtype | None, int] = {}
        try:
            self.info: dict[str, Any] = self.ranks.call("describe")  # every rank up and holding its shard
        except BaseException:
            self.ranks.close()
            raise

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        stats: dict[str, float] = self.ranks.call("train", batch.to("cpu"), version)
        return stats

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self.begin_export(dtype).result()

    def begin_export(self, dtype: torch.dtype | None = None) -> Future[dict[str, torch.Tensor]]:
        nbytes = self._export_bytes.get(dtype)
        if nbytes is None:  # the same every time: the ranks sum the weights' shapes once per dtype
            nbytes = self._export_bytes[dtype] = int(self.ranks.call("export_bytes", dtype))
            self._exports.cap_bytes = (_EXPORTS_KEPT + 1) * nbytes
        region = torch.frombuffer(self._exports.take(max(nbytes, 1)), dtype=torch.uint8)
        where = locate(region)
        assert where is not None, "the export pool hands out shared memory"
        segment, offset = where
        answered = self.ranks.submit("export", ExportTarget(segment.path, offset, nbytes), dtype)
        exported: Future[dict[str, torch.Tensor]] = Future()
        exported.set_running_or_notify_cancel()

        def unpack(done: Future[list[Placed]]) -> None:
            try:
                exported.set_result(placed_tensors(region, done.result()))
            except BaseException as error:  # handed to whoever waits on the export
                exported.set_exception(error)

        answered.add_done_callback(unpack)
        return exported

    def exports_copies(self, dtype: torch.dtype | None = None) -> bool:
        return True  # written by the ranks into a buffer of the pool, never written again while a tensor views it

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
