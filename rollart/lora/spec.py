"""`run.trainer.lora`: the LoRA settings, read by the trainer that trains adapters and the generators that serve them.

Part of the topology, so it imports no torch (the PEFT helpers over tensors are `rollart.lora.adapters`).
"""

from __future__ import annotations

from typing import Literal

import msgspec


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
