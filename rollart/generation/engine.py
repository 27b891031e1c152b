"""The generation engine interface every backend implements (transformers, vLLM, simulated).

An engine takes token ids and sampling parameters and returns the sampled tokens with their
log-probs under the sampling distribution (the behaviour policy, for off-policy correction) and
the weight version that produced each token. Many requests may be in flight at once; the engine
batches them. `abort` frees a request; `load_weights` swaps in a new version without stopping
the requests in flight (they finish partly under the old weights, and say so in `versions`).
Under LoRA (`run.trainer.lora`) a version is adapters only, on the base the engine loaded:
`load_adapter` (the transformers engine merges them in, vLLM serves them as LoRA adapters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec

from rollart.errors import RollartError

if TYPE_CHECKING:
    import torch

    from rollart.lora.spec import LoraSpec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """How to sample one response."""

    max_tokens: int
    """Upper bound on generated tokens."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    stop_token_ids: list[int] = []
    """Generation ends after any of these (the tokenizer's EOS is always one)."""
    seed: int | None = None
    """Per-request seed, for reproducible sampling."""
    prefill_only: bool = False
    """Disaggregated serving, the prefill half: compute the prompt's KV cache and hand it on to the engine
    that decodes (`kv_from` there); the result has no tokens. The vLLM engine does it with a KV store
    (`rollart.generation.vllm.kv_connector`), the simulated engine models it, the transformers engine refuses it."""
    kv_from: str | None = None
    """Disaggregated serving, the decode half: the prompt's KV cache comes from the engine that prefilled
    it (this names that generator and request), so this engine decodes without prefilling."""


class EngineClosed(RollartError):
    """The engine is not started, is closed, or its scheduler died (the cause is chained)."""


class InvalidRequest(RollartError, ValueError):
    """A request or a weight update that the engine cannot take; the message says why."""


class WeightsMismatch(InvalidRequest):
    """New weights whose names or shapes do not match the model's."""


FinishReason = Literal["stop", "length", "abort"]


class GenerationResult(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What one request produced."""

    token_ids: list[int]
    """Generated tokens (the stop token included when it was sampled)."""
    logprobs: list[float]
    """Log-prob of each generated token under the distribution it was sampled from."""
    versions: list[int]
    """Policy version of the weights that generated each token."""
    finish_reason: FinishReason
    prompt_tokens: int
    """How many prompt tokens were processed (for measuring a task's prefill/decode profile)."""
    queued_s: float = 0.0
    """Seconds the request waited in the engine's queue before it started; 0 where the engine does not
    say (the router then counts the wait as part of the call's service time)."""


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of how busy an engine is."""

    running: int
    """Requests being generated now."""
    waiting: int
    """Requests queued for the next batch."""
    busy_fraction: float
    """Fraction of wall time spent generating since the engine started."""
    generated_tokens: int
    """Tokens generated since start."""
    version: int
    """Policy version of the weights in use."""
    kv_reused_tokens: int = 0
    """Prompt tokens of decode halves (`kv_from`) that the engine did not compute: their KV cache came from the
    engine that prefilled them (or, vLLM, from its own prefix cache)."""


BUSY_WINDOW_S = 10.0
"""`RecentBusy` covers between this and twice this of the clock it is given."""


class RecentBusy:
    """An engine's busy fraction over its last `window_s` to 2 * `window_s`, from `EngineLoad.busy_fraction`
    (since the engine started): busy seconds are that fraction times the time up, and differences of them
    cancel any offset between the engine's start and the first `update`."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._start: float | None = None
        self._older = self._newer = (0.0, 0.0)
        """(time, busy seconds) marks; the fraction is measured since `_older`."""

    def update(self, fraction: float, now: float) -> float:
        """The recent fraction, given the fraction since start at `now` (any clock, always the same one)."""
        if self._start is None:
            self._start = now
            self._older = self._newer = (now, 0.0)
        busy = fraction * (now - self._start)
        if now - self._newer[0] >= self.window_s:
            self._older, self._newer = self._newer, (now, busy)
        since, busy_then = self._older
        if now <= since:
            return fraction
        return min(1.0, max(0.0, (busy - busy_then) / (now - since)))


class GenerationEngine(Protocol):
    """What the generator node drives."""

    async def start(self) -> None:
        """Load the model; after this `generate` may be called."""

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one response; cancelling the caller aborts the request."""

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free what it holds; its `generate` returns with finish_reason 'abort'.
        False when no such request is running."""

    async def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Swap in new weights (HF names) without stopping requests in flight."""

    async def load_adapter(self, version: int, adapters: Mapping[str, torch.Tensor], spec: LoraSpec) -> None:
        """Serve `version`: the base model with these LoRA adapters (PEFT's saved names, as the trainer exports
        them) in place of any earlier version's; requests in flight report the version of every token."""

    def load(self) -> EngineLoad: ...

    async def close(self) -> None: ...
