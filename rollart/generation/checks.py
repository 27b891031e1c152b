"""The rules every generation engine applies alike: which requests and which weight updates it takes, and how it
reports its load.

The transformers and vLLM engines hold the same model in different ways (live tensors; a checkpoint a spawned
engine core loaded), so each says what it expects (names and shapes, tied names, vocabulary, context length) and
these functions decide, with the same words in every error. Importing this module imports no torch: tensors are
only read (`.shape`) and compared with the `equal` the caller passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rollart.generation.engine import EngineLoad, InvalidRequest, SamplingParams, WeightsMismatch

if TYPE_CHECKING:
    import torch


def describe(names: list[str], limit: int = 8) -> str:
    """The first `limit` names, and how many there are when that is not all of them."""
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    context: tuple[int, str] | None,
    kv_handoff: bool = False,
) -> None:
    """`InvalidRequest` unless the prompt and sampling settings fit the model.

    `context`: the most prompt + response tokens and how the error names that limit ("the model's 1024"); None
    when the model sets none. `kv_handoff`: whether the engine takes the halves of a disaggregated turn."""
    if (params.prefill_only or params.kv_from is not None) and not kv_handoff:
        raise InvalidRequest(
            "this engine does not hand KV cache to another engine (rollout.routing: disaggregated): the vLLM "
            "engine does with generator.kv_store set, and the simulated engine (generator.backend: sim) models it"
        )
    if params.prefill_only and params.kv_from is not None:
        raise InvalidRequest("a request is either the prefill half (prefill_only) or the decode half (kv_from)")
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if not all(0 <= token < vocab_size for token in prompt_ids):
        raise InvalidRequest(f"the prompt has token ids outside the vocabulary [0, {vocab_size})")
    if params.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise InvalidRequest(f"need temperature >= 0 and 0 < top_p <= 1, got {params.temperature}, {params.top_p}")
    if context is not None and len(prompt_ids) + params.max_tokens > context[0]:
        raise InvalidRequest(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds {context[1]}"
        )


def check_newer(version: int, newest: int) -> None:
    """`InvalidRequest` unless `version` is newer than the newest the engine has (or has staged)."""
    if version <= newest:
        raise InvalidRequest(f"weights version {version} is not newer than version {newest}")


def check_weights(
    version: int,
    weights: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
    *,
    equal: Callable[[torch.Tensor, torch.Tensor], bool],
) -> None:
    """`WeightsMismatch` naming every problem unless `weights` fit the model.

    `expected`: the model's tensor names and shapes (empty: unknown, so names and shapes go unchecked).
    `aliases`: a name tied to another (`lm_head.weight` to the embeddings): optional in an update, and when both
    are given they must be equal (compared with `equal`, which may take as long as reading both tensors)."""
    problems = []
    if expected:
        missing = [name for name in expected if name not in weights and name not in aliases]
        unexpected = [name for name in weights if name not in expected and name not in aliases]
        wrong_shape = [
            f"{name} {tuple(tensor.shape)} (model: {expected[name]})"
            for name, tensor in weights.items()
            if name in expected and tuple(tensor.shape) != expected[name]
        ]
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape)):
            if names:
                problems.append(f"{label}: {describe(names)}")
    for alias, name in aliases.items():
        given_both = alias in weights and name in weights and weights[alias] is not weights[name]
        if given_both and not equal(weights[alias], weights[name]):
            problems.append(f"{alias} is tied to {name} in this model but differs from it")
    if problems:
        raise WeightsMismatch(f"weights for version {version} do not match the model: " + "; ".join(problems))


class LoadMeter:
    """What `GenerationEngine.load()` reports beyond the queue: busy time since start, tokens generated.

    Busy means at least one request is being generated: `busy()` when work starts (a no-op while already busy),
    `idle()` when the last of it ends."""

    def __init__(self) -> None:
        self.generated_tokens = 0
        self._started_at = 0.0
        self._busy_s = 0.0
        self._busy_since: float | None = None

    def start(self) -> None:
        """The engine is up: its time starts now."""
        self._started_at = time.monotonic()

    def busy(self) -> None:
        if self._busy_since is None:
            self._busy_since = time.monotonic()

    def idle(self) -> None:
        if self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def snapshot(self, *, running: int, waiting: int, version: int, kv_reused_tokens: int = 0) -> EngineLoad:
        now = time.monotonic()
        elapsed = now - self._started_at if self._started_at else 0.0
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        return EngineLoad(
            running=running,
            waiting=waiting,
            busy_fraction=min(1.0, busy / elapsed) if elapsed > 0 else 0.0,
            generated_tokens=self.generated_tokens,
            version=version,
            kv_reused_tokens=kv_reused_tokens,
        )
