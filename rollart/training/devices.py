"""Which device a training rank runs on and in which compute dtype: the same rule for every backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollart.training.spec import TrainerSpec


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def compute_dtype(spec: TrainerSpec, device: torch.device) -> torch.dtype | None:
    """The autocast dtype `precision` asks for on `device` (None: compute in the weights' dtype)."""
    if spec.master_dtype == "bf16":
        return None
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if spec.precision == "bf16" or (spec.precision == "auto" and bf16) else None
