"""The transformers generation engine: the reference backend that batches concurrent requests on CPU (or one GPU).

Concurrent `generate` calls wait in a queue. One scheduler task, owned by the engine, takes the oldest request and
every other waiting request that can share its sampling settings (up to `max_batch_size`), left-pads them and runs
one `model.generate` for the batch, with the KV cache, in the engine's single worker thread, so the event loop never
waits on torch. Each row is then trimmed at its own `max_tokens` or stop token.

Batches group requests by how they sample, since one `generate` call samples every row alike:
- greedy (temperature 0) requests share a batch whatever their seed or top_p;
- sampled requests share a batch when their (temperature, top_p) match;
- a request with a seed runs alone, under `torch.random.fork_rng` + `torch.manual_seed(seed)` in the worker thread:
  the same request with the same seed then gives the same tokens, whatever else is queued, and the global RNG that
  unseeded requests use is left as it was.

Log-probs are those of each sampled token under the distribution it was sampled from: `log_softmax` of the scores
`generate` sampled from, after temperature and top-p (top-k is always off). They are the behaviour policy's
log-probs for off-policy correction.

New weights (`load_weights`) are checked at once and staged. A running batch then stops at its next decode step
(every row has one more token by then); the scheduler copies the weights into the model and puts the rows that had
not finished back at the front of the queue as continuations: prompt + tokens so far, with what is left of
`max_tokens`. Their prefix is recomputed under the new weights, and every token reports the version that generated
it, so a long request ends partly under each version and a swap waits for one decode step, not the slowest request.
Aborting a queued request (a continuation included) answers it with what it has; aborting a running one marks its
row, which stops at the next decode step (and the whole batch stops when every row is aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rollart.engines.base import (
    EngineClosed,
    EngineLoad,
    FinishReason,
    GenerationResult,
    InvalidRequest,
    SamplingParams,
    WeightsMismatch,
)
from rollart.engines.loading import load_model_and_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(eq=False)
class _Request:
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
class _Row:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    """None: cut short by an abort or a weight swap (the request tells which)."""


class _RowStops(StoppingCriteria):
    """Per row: done at its own max_tokens, at one of its stop tokens (EOS included), or once aborted; every row is
    done once `swap_pending()` (the scheduler then continues the unfinished ones under the new weights)."""

    def __init__(
        self, batch: list[_Request], prompt_len: int, eos_ids: frozenset[int], swap_pending: Callable[[], bool]
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


def _describe(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


class HFEngine:
    """A `GenerationEngine` over a Hugging Face causal LM folder; see the module docstring for how it batches."""

    def __init__(
        self,
        model_path: Path | str,
        *,
        max_batch_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise InvalidRequest(f"max_batch_size must be at least 1, got {max_batch_size}")
        self._model_path = Path(model_path)
        self._max_batch_size = max_batch_size
        self._dtype = dtype
        self._device = torch.device(device)
        self._version = version
        self._model: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._targets: dict[str, torch.Tensor] = {}
        """The model's state_dict tensors (sharing storage with the parameters): where new weights are copied."""
        self._aliases: dict[str, str] = {}
        """Names that share storage with an earlier name (tied embeddings): optional in a weight update."""
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._waiting: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}
        self._pending_weights: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._wakeup = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._failure: BaseException | None = None
        self._started_at = 0.0
        self._busy_s = 0.0
        self._batch_started: float | None = None
        self._generated_tokens = 0
        self.batches_run = 0
        """How many `model.generate` calls have run (one per batch)."""

    # ---------------------------------------------------------------- life cycle

    async def start(self) -> None:
        """Load the model in the worker thread and start the scheduler."""
        if self._task is not None or self._closing:
            raise EngineClosed("start() may be called once, before close()")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._load)
        self._started_at = time.monotonic()
        self._task = asyncio.create_task(self._schedule(), name=f"hf-engine-scheduler:{self._model_path.name}")
        self._task.add_done_callback(self._on_scheduler_done)

    def _load(self) -> None:
        model, tokenizer = load_model_and_tokenizer(self._model_path, dtype=self._dtype, device=self._device)
        model.requires_grad_(False)
        eos: set[int] = set()
        for ids in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
            if isinstance(ids, int):
                eos.add(ids)
            elif ids is not None:
                eos.update(ids)
        if not eos:
            raise InvalidRequest(f"{self._model_path}: neither the tokenizer nor the model names an EOS token")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        # A clean generation config: a model's shipped defaults (top_k, repetition penalty, ...) would change the
        # sampling distribution behind the caller's back and make the reported log-probs wrong.
        model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            eos_token_id=sorted(eos), pad_token_id=pad
        )
        targets = model.state_dict()
        first_by_storage: dict[int, str] = {}
        for name, tensor in targets.items():
            key = tensor.untyped_storage().data_ptr()
            if key in first_by_storage:
                self._aliases[name] = first_by_storage[key]
            else:
                first_by_storage[key] = name
        self._model, self._tokenizer, self._targets = model, tokenizer, targets
        self._eos_ids, self._pad_id = frozenset(eos), int(pad)

    async def close(self) -> None:
        """Stop the scheduler; queued requests and the running batch come back with finish_reason 'abort'."""
        if self._closing:
            return
        self._closing = True
        for request in list(self._waiting.values()):
            request.answer("abort")
        self._waiting.clear()
        for request in self._running.values():
            request.aborted = True
        self._wakeup.set()
        if self._task is not None:
            # A crashed scheduler already failed every request with its error (see _on_scheduler_done).
            await asyncio.wait([self._task])
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)

    def _on_scheduler_done(self, task: asyncio.Task[None]) -> None:
        error: BaseException = EngineClosed("the engine's scheduler was cancelled")
        if not task.cancelled():
            failure = task.exception()
            if failure is None:
                return
            error = EngineClosed(f"the engine's scheduler failed: {failure!r}")
            error.__cause__ = failure
        self._failure = error
        for request in [*self._waiting.values(), *self._running.values()]:
            if not request.future.done():
                request.future.set_exception(error)
        self._waiting.clear()
        self._running.clear()

    def _check_open(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._task is None or self._closing:
            raise EngineClosed("the engine is not running (start() not called, or closed)")

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (after `start`)."""
        if self._tokenizer is None:
            raise EngineClosed("the engine is not started")
        return self._tokenizer

    @property
    def version(self) -> int:
        """The policy version of the weights in use."""
        return self._version

    # ---------------------------------------------------------------- requests

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Queue one request and wait for its result; cancelling the caller aborts the request."""
        self._check_open()
        if request_id in self._waiting or request_id in self._running:
            raise InvalidRequest(f"request {request_id!r} is already in flight")
        self._validate(prompt_ids, params)
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = _Request(request_id, list(prompt_ids), params, future)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._abort(request_id)
            raise

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        assert self._model is not None
        vocab = int(self._model.config.vocab_size)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if not all(0 <= token < vocab for token in prompt_ids):
            raise InvalidRequest(f"the prompt has token ids outside the vocabulary [0, {vocab})")
        if params.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise InvalidRequest(f"need temperature >= 0 and 0 < top_p <= 1, got {params.temperature}, {params.top_p}")
        limit = getattr(self._model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and len(prompt_ids) + params.max_tokens > limit:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's {limit}"
            )

    async def abort(self, request_id: str) -> bool:
        """Abort a queued or running request; False when there is no such request in flight."""
        return self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        if (request := self._waiting.pop(request_id, None)) is not None:
            request.answer("abort")
            return True
        if (request := self._running.get(request_id)) is not None:
            request.aborted = True
            return True
        return False

    # ---------------------------------------------------------------- weights

    async def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Check `weights` (HF names, as `state_dict()` gives) against the model and stage them as `version`.

        A running batch stops at its next decode step for them and its unfinished rows continue under them, as do
        requests submitted from now on. The tensors are read when applied, so the caller must not change them
        meanwhile. A tied name (`lm_head.weight` when tied to the embeddings) may be left out."""
        self._check_open()
        newest = self._pending_weights[0] if self._pending_weights is not None else self._version
        if version <= newest:
            raise InvalidRequest(f"weights version {version} is not newer than version {newest}")
        missing = [name for name in self._targets if name not in weights and name not in self._aliases]
        unexpected = [name for name in weights if name not in self._targets]
        wrong_shape = [
            f"{name} {tuple(tensor.shape)} (model: {tuple(self._targets[name].shape)})"
            for name, tensor in weights.items()
            if name in self._targets and tensor.shape != self._targets[name].shape
        ]
        problems = []
        if missing:
            problems.append(f"missing: {_describe(missing)}")
        if unexpected:
            problems.append(f"unexpected: {_describe(unexpected)}")
        if wrong_shape:
            problems.append(f"wrong shape: {_describe(wrong_shape)}")
        for alias, name in self._aliases.items():
            given_both = alias in weights and name in weights and weights[alias] is not weights[name]
            if given_both and not await asyncio.to_thread(torch.equal, weights[alias], weights[name]):
                problems.append(f"{alias} is tied to {name} in this model but differs from it")
        if problems:
            raise WeightsMismatch(f"weights for version {version} do not match the model: " + "; ".join(problems))
        self._pending_weights = (version, weights)
        self._wakeup.set()

    def _apply_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                if name not in self._aliases:
                    self._targets[name].copy_(tensor)

    # ---------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        """How busy the engine is now."""
        now = time.monotonic()
        elapsed = now - self._started_at if self._started_at else 0.0
        busy = self._busy_s + (now - self._batch_started if self._batch_started is not None else 0.0)
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            busy_fraction=min(1.0, busy / elapsed) if elapsed > 0 else 0.0,
            generated_tokens=self._generated_tokens,
            version=self._version,
        )

    # ---------------------------------------------------------------- scheduler

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._closing and not self._waiting and self._pending_weights is None:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._closing:
                return
            if self._pending_weights is not None:
                version, weights = self._pending_weights
                self._pending_weights = None
                await loop.run_in_executor(self._executor, self._apply_weights, weights)
                self._version = version
                continue  # newer weights may have been staged meanwhile
            if self._waiting:
                await self._run_batch(loop, self._take_batch())

    def _take_batch(self) -> list[_Request]:
        key = next(iter(self._waiting.values())).batch_key
        batch = [r for r in self._waiting.values() if r.batch_key == key][: self._max_batch_size]
        for request in batch:
            del self._waiting[request.request_id]
            self._running[request.request_id] = request
        return batch

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        """Generate for one batch and answer its callers, or queue them again when a weight swap cut them. If the
        scheduler is cancelled meanwhile, the requests stay in `_running`, where `_on_scheduler_done` fails them."""
        version = self._version
        self._batch_started = started = time.monotonic()
        try:
            rows = await loop.run_in_executor(self._executor, self._generate_batch, batch)
        except Exception as error:  # the batch failed: its callers get the error, later batches still run
            for request in batch:
                self._running.pop(request.request_id, None)
                if not request.future.done():
                    request.future.set_exception(error)
            return
        finally:
            self._busy_s += time.monotonic() - started
            self._batch_started = None
            self.batches_run += 1
        continued: dict[str, _Request] = {}
        for request, row in zip(batch, rows, strict=True):
            self._running.pop(request.request_id, None)
            self._generated_tokens += len(row.token_ids)
            request.tokens += row.token_ids
            request.logprobs += row.logprobs
            request.versions += [version] * len(row.token_ids)
            if row.finish_reason is not None and not request.aborted:
                request.answer(row.finish_reason)
            elif request.aborted:  # a cancelled caller aborts its request too
                request.answer("abort")
            else:
                continued[request.request_id] = request
        # First in the queue: they are the oldest requests, so the next batch (under the new weights) holds them.
        self._waiting = continued | self._waiting

    # ---------------------------------------------------------------- worker thread

    @contextlib.contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        if seed is None:
            yield
            return
        on_cpu = self._device.type == "cpu"
        devices = [] if on_cpu else [self._device.index or 0]
        device_type = "cuda" if on_cpu else self._device.type
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            torch.manual_seed(seed)
            yield

    def _generate_batch(self, batch: list[_Request]) -> list[_Row]:
        """Run one `generate` for the batch (all rows share sampling settings) and cut each row to its own end."""
        assert self._model is not None
        prompts = [r.prompt_ids + r.tokens for r in batch]
        prompt_len = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(batch), prompt_len), self._pad_id, dtype=torch.long)
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
            eos_token_id=sorted(self._eos_ids),
            pad_token_id=self._pad_id,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
            **sampling,
        )
        stops = _RowStops(batch, prompt_len, self._eos_ids, lambda: self._pending_weights is not None)
        with torch.inference_mode(), self._seeded(batch[0].seed):
            out = self._model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(self._device),
                attention_mask=attention_mask.to(self._device),
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
            rows.append(_Row(tokens_rows[i][:end], logp_rows[i][:end], reason))
        return rows
