"""One batch of the transformers engine: the queued request, and one `model.generate` over a batch of them.

This is the worker-thread side of `rollart.generation.hf.engine` (whose docstring says how requests are batched, seeded
and cut by a weight swap): `generate_batch` left-pads the batch, runs `generate` with the KV cache and a stopping rule
per row (`RowStops`), and cuts each row at its own `max_tokens`, stop token or abort, with the log-prob of every sampled
token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rollart.generation.engine import FinishReason, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(eq=False)
class Request:
    """One `generate` call, from the queue through the pieces a weight swap cuts it into, to its answer."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerationResult]
    aborted: bool = False
    """Set on the event loop, read by the worker thread between decode steps (a plain bool is enough under the GIL)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """What the pieces run so far generated: more than one piece when a weight swap cut the request."""

    @property
    def max_new(self) -> int:
        return self.params.max_tokens - len(self.tokens)

    @property
    def seed(self) -> int | None:
        """The seed of the next piece: the request's own for the first. A continuation is re-seeded from how far it
        got, since the same seed would replay the first piece's random draws; so a request cut by a swap is
        reproducible for that cut, but does not give the sample it would have without the swap."""
        p = self.params
        if p.temperature == 0 or p.seed is None:
            return None
        return hash((p.seed, len(self.tokens))) if self.tokens else p.seed

    @property
    def batch_key(self) -> tuple[object, ...]:
        """Requests with equal keys can share one `generate` call."""
        p = self.params
        if p.temperature == 0:
            return ("greedy",)
        if p.seed is not None:
            return ("seeded", self.request_id)
        return ("sample", p.temperature, p.top_p)

    def answer(self, finish_reason: FinishReason) -> None:
        """Give the caller every token generated so far (unless the caller is gone)."""
        if not self.future.done():
            prompt_tokens = len(self.prompt_ids) if self.tokens else 0  # a request that never ran processed none
            self.future.set_result(
                GenerationResult(
                    token_ids=self.tokens,
                    logprobs=self.logprobs,
                    versions=self.versions,
                    finish_reason=finish_reason,
                    prompt_tokens=prompt_tokens,
                )
            )


@dataclass
class Row:
    """What one batch generated for one request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    """None: cut short by an abort or a weight swap (the request tells which)."""


class RowStops(StoppingCriteria):
    """Per row: done at its own max_tokens, at one of its stop tokens (EOS included), or once aborted; every row is
    done once `swap_pending()` (the scheduler then continues the unfinished ones under the new weights)."""

    def __init__(
        self, batch: list[Request], prompt_len: int, eos_ids: frozenset[int], swap_pending: Callable[[], bool]
    ) -> None:
        self.batch = batch
        self.prompt_len = prompt_len
        self.swap_pending = swap_pending
        self.stops = [eos_ids | frozenset(r.params.stop_token_ids) for r in batch]
        self.aborted_at: list[int | None] = [None] * len(batch)
        """How many tokens a row had when its abort was seen."""

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_len
        last = input_ids[:, -1].tolist()
        done = []
        for i, request in enumerate(self.batch):
            if request.aborted and self.aborted_at[i] is None:
                self.aborted_at[i] = generated
            done.append(request.aborted or generated >= request.max_new or last[i] in self.stops[i])
        if self.swap_pending():
            done = [True] * len(done)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Sample under `seed` (None: the global RNG) without changing the global RNG state of `device` or the CPU."""
    if seed is None:
        yield
        return
    on_cpu = device.type == "cpu"
    devices = [] if on_cpu else [device.index or 0]
    device_type = "cuda" if on_cpu else device.type
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.manual_seed(seed)
        yield


def generate_batch(
    model: PreTrainedModel,
    batch: list[Request],
    *,
    eos_ids: frozenset[int],
    pad_id: int,
    device: torch.device,
    swap_pending: Callable[[], bool],
) -> list[Row]:
    """Run one `generate` for the batch (all rows share sampling settings) and cut each row to its own end."""
    prompts = [r.prompt_ids + r.tokens for r in batch]
    prompt_len = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(batch), prompt_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), prompt_len), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, prompt_len - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, prompt_len - len(prompt) :] = 1
    params = batch[0].params
    sampling: dict[str, Any] = {"do_sample": False}
    if params.temperature > 0:
        sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max(r.max_new for r in batch),
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        output_scores=True,
        return_dict_in_generate=True,
        use_cache=True,
        **sampling,
    )
    stops = RowStops(batch, prompt_len, eos_ids, swap_pending)
    with torch.inference_mode(), seeded(batch[0].seed, device):
        out = model.generate(  # type: ignore[operator]
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stops]),
        )
        generated_BT = out.sequences[:, prompt_len:]
        # Per step, so only one (batch, vocab) block of log-probs exists at a time.
        logp_BT = torch.stack(
            [
                torch.log_softmax(scores_BV.float(), dim=-1).gather(-1, generated_BT[:, t : t + 1]).squeeze(-1)
                for t, scores_BV in enumerate(out.scores)
            ],
            dim=1,
        )
    tokens_rows = generated_BT.tolist()
    logp_rows = logp_BT.tolist()
    rows = []
    for i, request in enumerate(batch):
        limit = min(request.max_new, len(tokens_rows[i]))
        aborted_at = stops.aborted_at[i]
        if aborted_at is not None:
            limit = min(limit, aborted_at)
        end = limit
        reason: FinishReason | None = "length" if limit == request.max_new else None
        for k, token in enumerate(tokens_rows[i][:limit]):
            if token in stops.stops[i]:
                end, reason = k + 1, "stop"
                break
        rows.append(Row(tokens_rows[i][:end], logp_rows[i][:end], reason))
    return rows
