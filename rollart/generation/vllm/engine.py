"""The vLLM generation engine: a `GenerationEngine` on vLLM's asyncio engine (`AsyncLLM`), on CPU or GPU.

vLLM lives in its own virtual environment (`bin/setup-vllm` makes `.venv-vllm`; docs/vllm.md says what is pinned
and why), so this module imports vLLM only when an engine starts: importing it has no side effects and works
without vLLM installed. vLLM starts its engine core in a spawned process, so a script that creates an engine needs
the `if __name__ == "__main__":` guard.

    engine = VLLMEngine("models/tiny")
    await engine.start()
    result = await engine.generate("r1", prompt_ids, SamplingParams(max_tokens=32, temperature=1.0))

Each request streams from `AsyncLLM.generate` (token ids in, token ids out, no detokenizing) and is collected into
a `GenerationResult`. Log-probs are those of the sampled tokens under the distribution they were sampled from:
`logprobs_mode="processed_logprobs"` makes vLLM report them after temperature and top-p, and nothing else shapes
that distribution (no top-k, min-p or penalties; the model's generation config contributes only its EOS ids).

New weights reach the running engine without a restart and without a file, and decoding pauses only for the swap:
the version is checked and staged in shared memory while the engine decodes (`weights.stage`: one copy per host,
none when it arrived in the receiver's shared buffers), every worker maps it (`worker.STAGE_METHOD`; under tensor
parallelism each worker takes its own shard when it loads), and then three engine-core calls are sent back to
back: the swap, which reloads every worker's model in place with the model's own weight loader
(`worker.StagedWeights`, mixed into the workers with `worker_extension_cls`), `set_weight_version`,
`reset_prefix_cache`. The engine core runs queued calls between two steps, so every step is labelled with the
version of the weights that ran it, and each token's version comes from those labels (vLLM's `weight_versions`
spans); a vLLM without them falls back to the version current when the token arrived. Two pitfalls are handled:
with tied embeddings `lm_head.weight` is loaded too (vLLM keeps its old lm_head otherwise), and the prefix cache
is reset (which vLLM refuses while requests hold cache blocks, so requests are also salted with the weight
version: a prefix cached under old weights never serves a request of a newer one).

Under LoRA (`lora=` the run's `LoraSpec`) vLLM starts with LoRA enabled, the base never changes, and each
version is adapters that vLLM serves natively (`load_adapter`): a request runs on the newest adapter when it
starts and keeps it to its end, so every token carries that adapter's version (`rollart.generation.vllm.lora`).

One piece, past the 400 lines of docs/architecture.md: one class whose life cycle, requests and two ways of taking
a new version share the same state (the flights in progress, the weights lock, closing); the parts that need none
of it are beside it (`args`, `weights`, `worker`, `lora`, `kv_connector` in this folder).

This module is the engine's life cycle, request streams and swap sequence; what it asks of vLLM and reads back is
`rollart.generation.vllm.args`, the checking and sending of new weights `rollart.generation.vllm.weights`, their
loading inside vLLM's worker `rollart.generation.vllm.worker`, and the checks it shares with the transformers engine
`rollart.generation.checks`.

One piece: `VLLMEngine` is one object around vLLM's engine, and its requests, weight loads, LoRA
adapters and KV handoff act on the same engine and versions; what could stand alone is in the modules above.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollart.generation.checks import LoadMeter, check_newer, check_request
from rollart.generation.engine import EngineClosed, EngineLoad, GenerationResult, InvalidRequest, SamplingParams
from rollart.generation.kv_store import KVStore
from rollart.generation.vllm.args import (
    FINISH_REASONS,
    EngineSettings,
    VLLMRequestFailed,
    create_engine,
    sampled_logprobs,
    span_versions,
    vllm_sampling_params,
)
from rollart.generation.vllm.lora import MAX_CPU_LORAS, MAX_LORAS, AdapterVersions, vllm_lora_rank
from rollart.generation.vllm.weights import (
    StagedVersion,
    VLLMWeightsFailed,
    checked_tensors,
    stage,
    tied_aliases,
)
from rollart.generation.vllm.worker import DROP_METHOD, STAGE_METHOD, SWAP_METHOD, failures
from rollart.models.checkpoint import checkpoint_shapes

if TYPE_CHECKING:
    import torch

    from rollart.lora.spec import LoraSpec

log = structlog.get_logger("rollart.generation.vllm")

_WEIGHTS_TIMEOUT_S = 60.0
"""Longest wait of vLLM's worker for the weight port and for each read from it."""


@dataclass(eq=False)
class _Flight:
    """A request in flight: abort sets `aborted`, which the streaming loop checks at each chunk."""

    aborted: bool = False


class VLLMEngine:
    """A `GenerationEngine` over a Hugging Face causal LM folder, run by vLLM; see the module docstring."""

    def __init__(
        self,
        model_path: Path | str,
        *,
        max_batch_size: int = 64,
        dtype: str | torch.dtype = "float32",
        version: int = 0,
        kv_cache_gb: float | None = None,
        cpu_threads_bind: str | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        cuda_devices: str | None = None,
        lora: LoraSpec | None = None,
        kv_store: Path | str | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """`kv_cache_gb`: memory for the KV cache (None: 1 GiB on CPU; on GPU vLLM sizes it from
        `gpu_memory_utilization`, the fraction of each GPU the engine may use). `cpu_threads_bind`: CPU cores for
        the engine's threads (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "0" or "0-3"; None: vLLM's choice); ignored on GPU.
        `enforce_eager`: skip graph compilation (None: eager on CPU, where compiling costs more start-up than it
        saves, compiled on GPU). `seed`: for requests without their own. `tensor_parallel_size`: GPUs the model is
        sharded over. `max_model_len`: longest prompt plus completion (None: the model's own). `cuda_devices`: the
        GPUs this engine uses (`CUDA_VISIBLE_DEVICES` of its processes; None: the process's own). `lora`: serve versions
        as LoRA adapters of this rank or less (`load_adapter`) instead of whole weights. `kv_store`: a folder shared
        with the other generators, through which this engine hands prefilled prompts' KV cache on and takes it
        (`rollout.routing: disaggregated`; `rollart.generation.vllm.kv_connector`); None: it serves whole turns only.
        `max_num_batched_tokens`: tokens one step computes at most, a longer prompt being prefilled in chunks (None:
        vLLM's default)."""
        if max_batch_size < 1:
            raise InvalidRequest(f"max_batch_size must be at least 1, got {max_batch_size}")
        if kv_cache_gb is not None and kv_cache_gb <= 0:
            raise InvalidRequest(f"kv_cache_gb must be positive, got {kv_cache_gb}")
        self._settings = EngineSettings(
            model_path=Path(model_path),
            max_batch_size=max_batch_size,
            dtype=dtype,
            kv_cache_gb=kv_cache_gb,
            cpu_threads_bind=cpu_threads_bind,
            enforce_eager=enforce_eager,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            cuda_devices=cuda_devices,
            max_lora_rank=None if lora is None else vllm_lora_rank(lora.rank),
            max_loras=MAX_LORAS,
            max_cpu_loras=MAX_CPU_LORAS,
            kv_store=None if kv_store is None else Path(kv_store),
        )
        self._model_path = self._settings.model_path
        self._version = version
        self._lora = None if lora is None else AdapterVersions(self._model_path, vllm_lora_rank(lora.rank))
        self._engine: Any = None
        """vllm's AsyncLLM once started (typed Any: vLLM is an optional dependency)."""
        self._vocab_size = 0
        self._max_model_len = 0
        self._checkpoint_shapes: dict[str, tuple[int, ...]] = {}
        self._aliases: dict[str, str] = {}
        """Tied names (lm_head to the embeddings): optional in an update, loaded from the embeddings' bytes."""
        self._weights_lock = asyncio.Lock()
        self.copied_bytes = 0
        """Bytes the last version's staging copied (0: every tensor already lay in shared memory)."""
        self._broken = ""
        """Why the engine serves no more (a worker failed in the middle of a swap); empty while it serves."""
        self._closed = asyncio.Event()
        self._flights: dict[str, _Flight] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self._closing = False
        self._meter = LoadMeter()
        self.start_seconds = 0.0
        """How long `start` took (engine process, model load, KV cache, warm-up)."""
        self._kv_store = None if kv_store is None else KVStore(Path(kv_store))
        self._kv_reused_tokens = 0
        """`EngineLoad.kv_reused_tokens`."""

    # ---------------------------------------------------------------- life cycle

    async def start(self) -> None:
        """Start vLLM's engine (a spawned engine-core process; 20-50 s on a small CPU) and label its weights."""
        if self._engine is not None or self._closing:
            raise EngineClosed("start() may be called once, before close()")
        config_file = self._model_path / "config.json"
        if not config_file.is_file():
            raise InvalidRequest(f"{self._model_path} is not a Hugging Face model folder (no config.json)")
        config = json.loads(config_file.read_text())
        self._checkpoint_shapes = await asyncio.to_thread(checkpoint_shapes, self._model_path)
        if self._kv_store is not None:
            await self._kv_store.start()
        self._aliases = tied_aliases(bool(config.get("tie_word_embeddings", False)), self._checkpoint_shapes)
        started = time.monotonic()
        try:
            # from_engine_args blocks until the engine core is up; a worker thread keeps the event loop free. The
            # engine comes back in a list, not as the thread's result: vLLM keeps tracebacks from that thread,
            # whose frames would hold a returned engine alive past close() (see _shutdown).
            created: list[Any] = []
            await asyncio.to_thread(create_engine, self._settings, created)
            self._engine = created.pop()
            await self._engine.update_weight_version(str(self._version))
        except BaseException:
            await self._shutdown()
            raise
        self.start_seconds = time.monotonic() - started
        self._meter.start()
        self._vocab_size = int(self._engine.model_config.get_vocab_size())
        self._max_model_len = int(self._engine.model_config.max_model_len)
        log.info("vllm engine started", model=str(self._model_path), seconds=round(self.start_seconds, 1))

    async def close(self) -> None:
        """Abort the requests in flight (their `generate` returns with finish_reason 'abort') and stop vLLM."""
        if self._closing:
            return
        self._closing = True
        self._closed.set()  # a weight load waiting on the engine core gives up: it will never answer now
        if self._engine is not None and self._flights:
            for flight in self._flights.values():
                flight.aborted = True
            await self._engine.abort(list(self._flights))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout=30)
        await self._shutdown()

    async def _shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            # Stop the output handler first: it would see the engine core die during shutdown and log an error.
            handler = getattr(engine, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.wait([handler])
            # Joins the engine-core process: seconds, so not on the event loop.
            await asyncio.to_thread(engine.shutdown)
            # AsyncLLM sits in reference cycles; collected at interpreter exit its __del__ shuts down again with
            # its module globals already gone, and prints a TypeError. Collect it now, while they exist.
            del engine
            gc.collect()
        if self._lora is not None:
            await asyncio.to_thread(self._lora.close)
        if self._kv_store is not None:
            await self._kv_store.close()

    def _running_engine(self) -> Any:
        if self._engine is None or self._closing:
            raise EngineClosed("the engine is not running (start() not called, or closed)")
        if self._engine.errored:
            raise EngineClosed(f"vLLM's engine died: {self._engine.dead_error!r}")
        if self._broken:
            raise EngineClosed(f"vLLM engine: {self._broken}")
        return self._engine

    @property
    def version(self) -> int:
        """The policy version of the weights in use."""
        return self._version

    @property
    def adapters(self) -> AdapterVersions | None:
        """Under LoRA: the adapter versions the engine holds and their folders (None: no LoRA)."""
        return self._lora

    # ---------------------------------------------------------------- requests

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one response; cancelling the caller aborts the request in vLLM."""
        from vllm import TokensPrompt  # type: ignore[import-not-found,unused-ignore]
        from vllm.v1.engine.exceptions import EngineDeadError  # type: ignore[import-not-found,unused-ignore]

        engine = self._running_engine()
        if request_id in self._flights:
            raise InvalidRequest(f"request {request_id!r} is already in flight")
        self._validate(prompt_ids, params)
        # The salt keeps prefixes cached under older weights from serving this request (see the module docstring).
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=f"rollart-v{self._version}")
        # Under LoRA: the adapter the request runs on to its end (None: the base, before the first version).
        lora = self._lora
        adapter = lora.acquire() if lora is not None else None
        started_on = adapter[0] if adapter is not None else self._version
        kv = self._kv_store.handoff(request_id, params) if self._kv_store is not None else None
        flight = self._flights[request_id] = _Flight()
        self._meter.busy()
        self._drained.clear()
        tokens: list[int] = []
        logprobs: list[float] = []
        arrival_versions: list[int] = []
        finish: str | None = None
        spans: Any = None
        try:
            lora_request = None if adapter is None else adapter[1]
            sampling = vllm_sampling_params(params, kv)
            stream = engine.generate(prompt, sampling, request_id, lora_request=lora_request)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    completion = out.outputs[0]
                    new_tokens = [int(t) for t in completion.token_ids]
                    tokens += new_tokens
                    arrival_versions += [self._version] * len(new_tokens)
                    logprobs += sampled_logprobs(new_tokens, completion.logprobs)
                    self._meter.generated_tokens += len(new_tokens)
                    if out.finished:
                        finish, spans = completion.finish_reason, getattr(completion, "weight_versions", None)
                        if kv is not None and kv[0] == "load":
                            self._kv_reused_tokens += int(out.num_cached_tokens or 0)
                        break
                    if flight.aborted:
                        # Aborted before vLLM knew the request: leaving the stream aborts it (aclosing).
                        finish = "abort"
                        break
        except EngineDeadError as error:
            raise EngineClosed(f"vLLM's engine died during request {request_id!r}") from error
        finally:
            await self._ended(request_id, engine, adapter, kv, finish)
        reason = FINISH_REASONS.get(str(finish)) if finish is not None else "abort"
        if reason is None:
            raise VLLMRequestFailed(f"vLLM ended request {request_id!r} with finish_reason {finish!r}")
        if params.prefill_only:  # its one sampled token is the decode half's to sample
            reason = "abort" if reason == "abort" else "length"
            return GenerationResult(
                token_ids=[], logprobs=[], versions=[], finish_reason=reason, prompt_tokens=len(prompt_ids)
            )
        return GenerationResult(
            token_ids=tokens,
            logprobs=logprobs,
            # Under LoRA one adapter generated every token (the steps' labels would be the base's).
            versions=[started_on] * len(tokens)
            if lora is not None
            else span_versions(spans, len(tokens)) or arrival_versions,
            finish_reason=reason,
            prompt_tokens=len(prompt_ids),
        )

    async def _ended(
        self,
        request_id: str,
        engine: Any,
        adapter: tuple[int, Any] | None,
        kv: tuple[str, str] | None,
        finish: str | None,
    ) -> None:
        """A request has left vLLM: release its adapter, and tell the KV store (`KVStore.ended`)."""
        del self._flights[request_id]
        if not self._flights:
            self._meter.idle()
            self._drained.set()
        if adapter is not None:
            await self._adapter_released(engine, adapter[0])
        if kv is not None:
            assert self._kv_store is not None
            await self._kv_store.ended(kv, finish)

    async def _adapter_released(self, engine: Any, version: int) -> None:
        """A request on adapter `version` has ended: remove the adapters nothing uses any more."""
        assert self._lora is not None
        self._lora.release(version)
        if not self._closing:  # close() removes every adapter with the engine
            await self._unless_closed(asyncio.ensure_future(self._lora.retire(engine)), "removing LoRA adapters")

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        context = (self._max_model_len, f"the engine's max_model_len {self._max_model_len}")
        handoff = self._kv_store is not None
        check_request(prompt_ids, params, vocab_size=self._vocab_size, context=context, kv_handoff=handoff)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its `generate` returns with finish_reason 'abort'. False when it is not in flight."""
        flight = self._flights.get(request_id)
        if flight is None or self._engine is None:
            return False
        flight.aborted = True
        await self._engine.abort(request_id)
        return True

    # ---------------------------------------------------------------- weights

    async def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Load `weights` (HF names, as `state_dict()` gives, any float dtype) into the running engine as `version`,
        on every one of its workers or on none.

        The engine keeps decoding while the version is checked and staged, and while every worker maps it; it
        pauses only for the swap, between two steps. Requests in flight keep going: the steps after the swap run
        the new weights and their tokens say so. With tied embeddings `lm_head.weight` may be left out. The tensors
        are read during the call only, and no reference is kept once it returns.

        `VLLMWeightsFailed` when a worker could not stage the version: every worker still runs the old one, under
        its label. When a worker fails during the swap itself, the workers may hold parts of two versions: the
        engine then serves nothing more (`EngineClosed`, also raised here), and its node exits to be restarted."""
        if self._lora is not None:
            raise InvalidRequest("this engine serves LoRA adapters (load_adapter): its base weights never change")
        async with self._weights_lock:
            engine = self._running_engine()
            check_newer(version, self._version)
            started = time.monotonic()
            tensors = await asyncio.to_thread(checked_tensors, version, weights, self._checkpoint_shapes, self._aliases)
            staged = await asyncio.to_thread(stage, version, tensors, self._aliases)
            try:
                staged_s = time.monotonic() - started
                mapped = await self._stage_on_workers(engine, staged)
                swap_started = time.monotonic()
                mapped_s = swap_started - started - staged_s
                # Sent back to back, in this order (gather starts its awaitables in order and each sends before it
                # waits): the engine core runs all three between two steps, so no step runs the new weights under
                # the old label.
                calls = asyncio.gather(
                    engine.collective_rpc(SWAP_METHOD, args=(version,)),
                    engine.update_weight_version(str(version)),
                    engine.reset_prefix_cache(),
                    return_exceptions=True,
                )
                swapped, labelled, reset = await self._unless_closed(calls, f"swapping in version {version}")
            finally:
                staged.close()
            if isinstance(swapped, BaseException) or failures(swapped):
                why = repr(swapped) if isinstance(swapped, BaseException) else "; ".join(failures(swapped))
                self._broken = f"swapping in version {version} failed ({why})"
                log.error("vllm weights mixed", version=version, error=why)
                raise EngineClosed(f"vLLM engine: {self._broken}; its workers may hold parts of two versions")
            for outcome in (labelled, reset):
                if isinstance(outcome, BaseException):
                    raise outcome
            self._version = version
            self.copied_bytes = staged.copied_bytes
            reports = swapped if isinstance(swapped, list) else []
            log.info(
                "vllm weights loaded",
                version=version,
                tensors=len(tensors),
                workers=len(reports),
                copied_mb=round(staged.copied_bytes / 2**20, 1),
                seconds=round(time.monotonic() - started, 3),
                staged_s=round(staged_s, 3),
                mapped_s=round(mapped_s, 3),
                worker_stage_s=max((round(float(r.get("stage_s", 0.0)), 4) for r in mapped), default=0.0),
                swap_s=round(time.monotonic() - swap_started, 3),
                worker_swap_s=max((round(float(r.get("swap_s", 0.0)), 4) for r in reports), default=0.0),
                prefix_cache_reset=bool(reset),
            )

    async def _stage_on_workers(self, engine: Any, staged: StagedVersion) -> list[dict[str, Any]]:
        """Every worker maps `staged`, or none keeps it: `VLLMWeightsFailed` (the model untouched) otherwise; the
        workers' answers."""
        version = staged.ticket.version
        mapping = asyncio.ensure_future(engine.collective_rpc(STAGE_METHOD, args=(staged.ticket.to_rpc(),)))
        answers = await self._unless_closed(mapping, f"staging version {version}")
        if failed := failures(answers):
            dropping = asyncio.ensure_future(engine.collective_rpc(DROP_METHOD))
            await self._unless_closed(dropping, f"dropping version {version}")
            raise VLLMWeightsFailed(
                f"vLLM's workers did not stage version {version} (the model still runs version {self._version}): "
                + "; ".join(failed)
            )
        return list(answers)

    async def load_adapter(self, version: int, adapters: Mapping[str, torch.Tensor], spec: LoraSpec) -> None:
        """Serve LoRA `adapters` (PEFT's names) as `version` to every request started from now on; requests in
        flight finish on the adapter they started with, and older adapters are removed once none uses them."""
        if self._lora is None:
            raise InvalidRequest("this engine was started without LoRA (run.trainer.lora): it loads whole weights")
        async with self._weights_lock:
            engine = self._running_engine()
            check_newer(version, self._version)
            started = time.monotonic()
            adding = self._lora.add(engine, version, adapters, spec, self._checkpoint_shapes)
            await self._unless_closed(asyncio.ensure_future(adding), f"adding the adapter of version {version}")
            self._version = version
            log.info("vllm adapter loaded", version=version, seconds=round(time.monotonic() - started, 3))

    async def _unless_closed(self, calls: asyncio.Future[Any], what: str) -> Any:
        """`calls`' result; `EngineClosed` as soon as `close()` starts instead. An engine core that shuts
        down rejects the utility calls queued to it and never answers them, so without this a weight load
        under way when a node drains would wait forever, and the node with it."""
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait([calls, closed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not calls.done():
            calls.cancel()
            raise EngineClosed(f"the vLLM engine closed while {what}")
        return calls.result()

    # ---------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        """How busy the engine is. vLLM runs up to `max_batch_size` requests at once and queues the rest; it does
        not say which are which without its stats loggers, so running/waiting split the requests vLLM holds at
        that cap (KV-cache pressure can queue more)."""
        in_flight = int(self._engine.get_num_unfinished_requests()) if self._engine is not None else 0
        cap = self._settings.max_batch_size
        return self._meter.snapshot(
            running=min(in_flight, cap),
            waiting=max(0, in_flight - cap),
            version=self._version,
            kv_reused_tokens=self._kv_reused_tokens,
        )
