"""What a training rank holds: model-state bytes counted from its tensors, and its peak memory.

Model state is parameters, gradients and optimizer state, counted from this rank's own tensors (an
FSDP2 shard's local part, not the whole parameter): what sharding divides by the rank count. Peak
memory is the high-water mark since `reset_peak`: on a GPU `torch.cuda.max_memory_allocated`; on
a CPU the process's resident high-water mark (VmHWM), reset through `/proc/self/clear_refs` (Linux),
which counts everything the process touched: activations, logits, buffers, the Python heap.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def state_bytes(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Parameter, gradient and optimizer-state bytes on this rank, and their sum (`state_bytes`)."""
    params = list(params)
    out = {
        "param_bytes": float(sum(local_bytes(p) for p in params)),
        "grad_bytes": float(sum(local_bytes(p.grad) for p in params if p.grad is not None)),
        "optim_bytes": float(
            sum(local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
        ),
    }
    out["state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    return out


def reset_peak(device: torch.device) -> None:
    """Start a new high-water mark (at a step's start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _CLEAR_REFS.exists():
        _CLEAR_REFS.write_text("5")


def peak_bytes(device: torch.device) -> float:
    """The high-water mark since `reset_peak` (0 where the platform has none)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    if not _STATUS.exists():
        return 0.0
    found = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    return float(int(found.group(1)) * 1024) if found else 0.0
