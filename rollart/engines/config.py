"""`run.generator`: which inference engine every generator node runs, and how large its batches are.

Part of the topology (`rollart.topology`), so it imports no torch: the launcher and the CLI read it without loading
an engine. The generator node builds its engine from it (`rollart.nodes.generator`).
"""

from __future__ import annotations

from typing import Literal

import msgspec


class GeneratorSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The inference engine every generator node runs."""

    backend: Literal["vllm", "hf", "sim"] = "vllm"
    """vllm: vLLM's async engine (`bin/setup-vllm`; `rollart run` sets it up when missing);
    hf: transformers, for machines without vLLM and for fast tests; sim: simulated (`run.sim`)."""
    max_batch_size: int = 64
    """Most requests batched in one step."""
    dtype: Literal["float32", "bfloat16"] = "float32"
