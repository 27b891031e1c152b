"""The FSDP2 training engine (`run.trainer.backend: fsdp2`): the trainer node's side of its ranks.

The node stays one asyncio daemon; this engine starts its rank processes (`RankGroup`, one per
device: gloo on CPU, NCCL on GPU) and drives them. Each step the whole packed batch goes to rank 0,
which broadcasts it; every rank trains on its token-balanced share (`rollart.training.step`), and
the statistics come back summed over ranks, with each rank's model-state and peak bytes
(`state_bytes_rN`, `peak_bytes_rN`). Weights come back bucket by bucket in Hugging Face names, each
tensor gathered whole only while its bucket is on the way.

Checkpoints are `torch.distributed.checkpoint` shards (`dcp/`), beside the model's config and
tokenizer: `save` returns as soon as the shards are staged in memory, the write goes on in the
background, and its future completes when the folder is whole. They load onto any number of ranks;
`rollart export` turns one into a Hugging Face model folder (`rollart.training.export`).

With `lora` the ranks train PEFT adapters on a frozen base (`rollart.training.fsdp.rank`); their
targets are checked here, against the model built on the meta device, before any rank starts, so a
bad one fails as a ConfigError rather than as a rank that died.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollart.errors import RollartError
from rollart.training.fsdp.rank import rank_main
from rollart.training.layout import DCP_FOLDER, ENGINE_FILE
from rollart.training.ranks.engine import RankGroupEngine
from rollart.training.spec import RankLayout, TrainerSpec


class FSDPTrainer(RankGroupEngine):
    """Drives this node's FSDP2 ranks (module docstring); it owns rank 0, so it is the primary."""

    backend = "fsdp2"

    def __init__(self, model_path: str | Path, spec: TrainerSpec, *, seed: int, layout: RankLayout) -> None:
        if spec.lora is not None:
            from rollart.lora.adapters import check_model_targets

            check_model_targets(model_path, spec.lora)
        super().__init__(model_path, spec, seed=seed, layout=layout, entry=rank_main)

    def full_state(self) -> dict[str, Any]:
        """Weights and optimizer state, whole, by parameter name (the rank group's `full_state`)."""
        state: dict[str, Any] = self.ranks.call("full_state")
        return state

    def load(self, path: Path) -> None:
        if not (path / DCP_FOLDER).is_dir():
            raise RollartError(
                f"{path} holds no {DCP_FOLDER}/ shards: it was not written by the fsdp2 backend (the torch "
                "backend writes a Hugging Face folder); resume with the backend that wrote it, or start a "
                "new run from it with `rollart export` and run.model.path"
            )
        lora = "lora" in json.loads((path / ENGINE_FILE).read_text())
        if lora != (self.spec.lora is not None):
            held = "LoRA adapters" if lora else "every weight (full fine-tuning)"
            raise RollartError(
                f"{path} holds {held}; run.trainer.lora must be {'set' if lora else 'unset'} to resume it"
            )
        self.ranks.call("load", str(path))
