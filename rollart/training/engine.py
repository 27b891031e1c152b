"""The training engine interface every backend implements (`rollart.training.registry` builds one).

A training engine owns the policy's trainable weights and optimizer. The trainer node hands it
one packed batch per step (`rollart.algorithms.grpo.PackedBatch`, advantages already computed);
the engine runs the GRPO loss over micro-batches, takes the optimizer step(s), and reports what
happened. Weights leave it by Hugging Face name (`export_weights`), which is what generators load,
whatever the engine's own layout (Megatron shards and fuses them; it must un-fuse here).

All methods block: the node calls them in a worker thread so its event loop keeps serving.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rollart.algorithms.grpo import PackedBatch


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

    def begin_export(self, dtype: torch.dtype | None = None) -> Future[dict[str, torch.Tensor]]:
        """`export_weights` without waiting for it: returns once the export is ordered before anything that
        changes the weights (the next `train_step`, `load`), so the future's tensors are these weights, never a
        mix of two steps. An engine whose ranks export in the background (fsdp2, megatron) returns at once."""

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
