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

Under LoRA (`load_adapter`) a version is adapters for the base the engine loaded: the engine keeps a copy of the
base weights they target (taken from the model as loaded, the first time a module is targeted) and stages
`merge_adapters(base, adapters)` as a partial update through the same swap; the modules an earlier version adapted
and this one does not go back to their base, so each version replaces the last instead of adding to it.

This module is the engine's event-loop side (queue, scheduler, weight staging); one batch in the worker thread is
`rollart.generation.hf.batch`, and the request and weight checks it shares with the vLLM engine are
`rollart.generation.checks`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import structlog
import torch
from transformers import GenerationConfig

from rollart.generation.checks import LoadMeter, check_newer, check_request, check_weights, describe
from rollart.generation.engine import (
    EngineClosed,
    EngineLoad,
    GenerationResult,
    InvalidRequest,
    SamplingParams,
    WeightsMismatch,
)
from rollart.generation.hf.batch import Request, Row, generate_batch
from rollart.models.loading import load_model_and_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rollart.lora.spec import LoraSpec

log = structlog.get_logger("rollart.generation.hf")


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
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._aliases: dict[str, str] = {}
        """Names that share storage with an earlier name (tied embeddings): optional in a weight update."""
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._waiting: dict[str, Request] = {}
        self._running: dict[str, Request] = {}
        self._pending_weights: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._serving: Literal["weights", "adapters"] | None = None
        """What the versions loaded so far were: whole weights or LoRA adapters (an engine takes one kind)."""
        self._lora_base: dict[str, torch.Tensor] = {}
        """Copies of the base weights that LoRA adapters have targeted, as loaded: what each version merges into."""
        self._adapter_lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._failure: BaseException | None = None
        self._meter = LoadMeter()
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
        self._meter.start()
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
        self._shapes = {name: tuple(tensor.shape) for name, tensor in targets.items()}
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
        self._waiting[request_id] = Request(request_id, list(prompt_ids), params, future)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._abort(request_id)
            raise

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        assert self._model is not None  # _check_open passed: the model is loaded
        limit = getattr(self._model.config, "max_position_embeddings", None)
        context = (limit, f"the model's {limit}") if isinstance(limit, int) else None
        check_request(prompt_ids, params, vocab_size=int(self._model.config.vocab_size), context=context)

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
        self._check_serving("weights")
        check_newer(version, self._newest_version())
        # In a thread: comparing a tied pair reads both tensors.
        await asyncio.to_thread(check_weights, version, weights, self._shapes, self._aliases, equal=torch.equal)
        check_newer(version, self._newest_version())  # another update may have been staged meanwhile
        self._serving = "weights"
        self._pending_weights = (version, weights)
        self._wakeup.set()

    async def load_adapter(self, version: int, adapters: Mapping[str, torch.Tensor], spec: LoraSpec) -> None:
        """Stage `version`: the base model with `adapters` (PEFT's saved names) merged in, replacing any earlier
        adapter version; applied between two decode steps like `load_weights`. `WeightsMismatch` when the adapters
        target weights the model lacks or do not fit them."""
        self._check_open()
        self._check_serving("adapters")
        check_newer(version, self._newest_version())
        async with self._adapter_lock:
            merged = await asyncio.to_thread(self._merge_adapters, version, adapters, spec)
            check_newer(version, self._newest_version())  # another update may have been staged meanwhile
            self._serving = "adapters"
            self._pending_weights = (version, merged)
            self._wakeup.set()

    def _merge_adapters(
        self, version: int, adapters: Mapping[str, torch.Tensor], spec: LoraSpec
    ) -> dict[str, torch.Tensor]:
        """In a thread: every base weight any adapter version has targeted, with this version's merged in."""
        from rollart.lora.adapters import adapter_base_names, merge_adapters

        try:
            names = adapter_base_names(adapters)
        except ValueError as error:
            raise WeightsMismatch(f"adapters for version {version}: {error}") from error
        if unknown := [name for name in names if name not in self._shapes or name in self._aliases]:
            raise WeightsMismatch(f"adapters for version {version} target weights the model lacks: {describe(unknown)}")
        with torch.no_grad():
            # Only a staged update writes the model, and none has written these names yet: they are the base.
            for name in names:
                if name not in self._lora_base:
                    self._lora_base[name] = self._targets[name].detach().clone()
            try:
                merged = merge_adapters(self._lora_base, adapters, spec)
            except ValueError as error:
                raise WeightsMismatch(f"adapters for version {version}: {error}") from error
        return self._lora_base | merged

    def _check_serving(self, kind: Literal["weights", "adapters"]) -> None:
        if self._serving not in (None, kind):
            raise InvalidRequest(f"this engine serves {self._serving}: it cannot also load {kind}")

    def _newest_version(self) -> int:
        return self._pending_weights[0] if self._pending_weights is not None else self._version

    def _apply_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                if name not in self._aliases:
                    self._targets[name].copy_(tensor)

    # ---------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        """How busy the engine is now."""
        return self._meter.snapshot(running=len(self._running), waiting=len(self._waiting), version=self._version)

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
                swap_started = time.perf_counter()
                await loop.run_in_executor(self._executor, self._apply_weights, weights)
                self._version = version
                log.info("hf weights swapped", version=version, swap_s=round(time.perf_counter() - swap_started, 4))
                continue  # newer weights may have been staged meanwhile
            if self._waiting:
                await self._run_batch(loop, self._take_batch())

    def _take_batch(self) -> list[Request]:
        key = next(iter(self._waiting.values())).batch_key
        batch = [r for r in self._waiting.values() if r.batch_key == key][: self._max_batch_size]
        for request in batch:
            del self._waiting[request.request_id]
            self._running[request.request_id] = request
        return batch

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[Request]) -> None:
        """Generate for one batch and answer its callers, or queue them again when a weight swap cut them. If the
        scheduler is cancelled meanwhile, the requests stay in `_running`, where `_on_scheduler_done` fails them."""
        version = self._version
        self._meter.busy()
        try:
            rows = await loop.run_in_executor(self._executor, self._generate_batch, batch)
        except Exception as error:  # the batch failed: its callers get the error, later batches still run
            for request in batch:
                self._running.pop(request.request_id, None)
                if not request.future.done():
                    request.future.set_exception(error)
            return
        finally:
            self._meter.idle()
            self.batches_run += 1
        continued: dict[str, Request] = {}
        for request, row in zip(batch, rows, strict=True):
            self._running.pop(request.request_id, None)
            self._meter.generated_tokens += len(row.token_ids)
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

    def _generate_batch(self, batch: list[Request]) -> list[Row]:
        """In the worker thread: one `generate` for the batch, cut short by a weight update staged meanwhile."""
        assert self._model is not None  # started: the scheduler runs only after _load
        return generate_batch(
            self._model,
            batch,
            eos_ids=self._eos_ids,
            pad_id=self._pad_id,
            device=self._device,
            swap_pending=self._swap_pending,
        )

    def _swap_pending(self) -> bool:
        """Read by the worker thread between decode steps: new weights wait for the running batch to stop."""
        return self._pending_weights is not None
