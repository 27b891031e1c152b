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

New weights reach the running engine without a restart and without pausing it: they are written as safetensors
into a staging folder the engine owns, and three engine-core calls are sent back to back: `reload_weights` from
that folder, `set_weight_version`, `reset_prefix_cache`. The engine core runs queued calls between two steps, so
every step is labelled with the version of the weights that ran it, and each token's version comes from those
labels (vLLM's `weight_versions` spans); a vLLM without them falls back to the version current when the token
arrived. Two pitfalls are handled: with tied embeddings `lm_head.weight` is sent too (vLLM keeps its old lm_head
otherwise), and the prefix cache is reset (which vLLM refuses while requests hold cache blocks, so requests are
also salted with the weight version: a prefix cached under old weights never serves a request of a newer one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollart.engines.base import (
    EngineClosed,
    EngineLoad,
    FinishReason,
    GenerationResult,
    InvalidRequest,
    SamplingParams,
    WeightsMismatch,
)
from rollart.errors import RollartError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("rollart.engines.vllm")

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_ENV_LOCK = threading.Lock()
"""vLLM reads its CPU settings from the environment of the process it spawns: one engine start at a time edits it."""
_TIED_NAME = "lm_head.weight"
_EMBED_NAME = "model.embed_tokens.weight"


class VLLMRequestFailed(RollartError):
    """vLLM ended a request with an error of its own (finish_reason 'error' or an unknown reason)."""


@dataclass(eq=False)
class _Flight:
    """A request in flight: abort sets `aborted`, which the streaming loop checks at each chunk."""

    aborted: bool = False


def _describe(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


@contextlib.contextmanager
def _environ(updates: Mapping[str, str | None]) -> Iterator[None]:
    """Set (None: unset) environment variables for the duration (the spawned engine core copies them), then
    restore them."""

    def apply(values: Mapping[str, str | None]) -> None:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in updates}
        apply(updates)
        try:
            yield
        finally:
            apply(saved)


class VLLMEngine:
    """A `GenerationEngine` over a Hugging Face causal LM folder, run by vLLM; see the module docstring."""

    def __init__(
        self,
        model_path: Path | str,
        *,
        max_batch_size: int = 64,
        dtype: str | torch.dtype = "float32",
        version: int = 0,
        kv_cache_gb: float | None = 1,
        cpu_threads_bind: str | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
    ) -> None:
        """`kv_cache_gb`: memory for the KV cache (None: vLLM sizes it, on GPU from `gpu_memory_utilization`).
        `cpu_threads_bind`: CPU cores for the engine's threads (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "0" or "0-3";
        None: vLLM's choice); ignored on GPU. `enforce_eager`: skip graph compilation (None: eager on CPU, where
        compiling costs more start-up than it saves, compiled on GPU). `seed`: for requests without their own."""
        if max_batch_size < 1:
            raise InvalidRequest(f"max_batch_size must be at least 1, got {max_batch_size}")
        if kv_cache_gb is not None and kv_cache_gb <= 0:
            raise InvalidRequest(f"kv_cache_gb must be positive, got {kv_cache_gb}")
        self._model_path = Path(model_path)
        self._max_batch_size = max_batch_size
        self._dtype = dtype
        self._version = version
        self._kv_cache_gb = kv_cache_gb
        self._cpu_threads_bind = cpu_threads_bind
        self._enforce_eager = enforce_eager
        self._seed = seed
        self._engine: Any = None
        """vllm's AsyncLLM once started (typed Any: vLLM is an optional dependency)."""
        self._vocab_size = 0
        self._max_model_len = 0
        self._checkpoint_shapes: dict[str, tuple[int, ...]] = {}
        self._tied = False
        self._staging: Path | None = None
        self._weights_lock = asyncio.Lock()
        self._flights: dict[str, _Flight] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self._closing = False
        self._started_at = 0.0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._generated_tokens = 0
        self.start_seconds = 0.0
        """How long `start` took (engine process, model load, KV cache, warm-up)."""

    # ---------------------------------------------------------------- life cycle

    async def start(self) -> None:
        """Start vLLM's engine (a spawned engine-core process; 20-50 s on a small CPU) and label its weights."""
        if self._engine is not None or self._closing:
            raise EngineClosed("start() may be called once, before close()")
        config_file = self._model_path / "config.json"
        if not config_file.is_file():
            raise InvalidRequest(f"{self._model_path} is not a Hugging Face model folder (no config.json)")
        config = json.loads(config_file.read_text())
        self._checkpoint_shapes = await asyncio.to_thread(_checkpoint_shapes, self._model_path)
        self._tied = bool(config.get("tie_word_embeddings", False))
        self._staging = Path(tempfile.mkdtemp(prefix="rollart-vllm-weights-"))
        started = time.monotonic()
        try:
            # from_engine_args blocks until the engine core is up; a worker thread keeps the event loop free. The
            # engine comes back in a list, not as the thread's result: vLLM keeps tracebacks from that thread,
            # whose frames would hold a returned engine alive past close() (see _shutdown).
            created: list[Any] = []
            await asyncio.to_thread(self._create_engine, created)
            self._engine = created.pop()
            await self._engine.update_weight_version(str(self._version))
        except BaseException:
            await self._shutdown()
            raise
        self.start_seconds = time.monotonic() - started
        self._started_at = time.monotonic()
        self._vocab_size = int(self._engine.model_config.get_vocab_size())
        self._max_model_len = int(self._engine.model_config.max_model_len)
        log.info("vllm engine started", model=str(self._model_path), seconds=round(self.start_seconds, 1))

    def _create_engine(self, created: list[Any]) -> None:
        from vllm import AsyncEngineArgs  # type: ignore[import-not-found,unused-ignore]
        from vllm.platforms import current_platform  # type: ignore[import-not-found,unused-ignore]
        from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]

        on_cpu = bool(current_platform.is_cpu())
        env: dict[str, str | None] = {}
        if on_cpu and self._kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # the legacy variable would override kv_cache_memory_bytes
        if on_cpu and self._cpu_threads_bind is not None:
            # An explicit core list; vLLM then reserves no core of its own (with "auto" it keeps one for its
            # scheduler process, which on 2 shared cores ran 16 x 32 tokens 5x faster than using both).
            env["VLLM_CPU_OMP_THREADS_BIND"] = self._cpu_threads_bind
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        enforce_eager = on_cpu if self._enforce_eager is None else self._enforce_eager
        args = AsyncEngineArgs(
            model=str(self._model_path),
            dtype=self._dtype,  # type: ignore[arg-type,unused-ignore]
            seed=self._seed,
            max_num_seqs=self._max_batch_size,
            kv_cache_memory_bytes=None if self._kv_cache_gb is None else int(self._kv_cache_gb * 2**30),
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            disable_log_stats=True,
        )
        with _environ(env):
            created.append(AsyncLLM.from_engine_args(args))

    async def close(self) -> None:
        """Abort the requests in flight (their `generate` returns with finish_reason 'abort') and stop vLLM."""
        if self._closing:
            return
        self._closing = True
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
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def _running_engine(self) -> Any:
        if self._engine is None or self._closing:
            raise EngineClosed("the engine is not running (start() not called, or closed)")
        if self._engine.errored:
            raise EngineClosed(f"vLLM's engine died: {self._engine.dead_error!r}")
        return self._engine

    @property
    def version(self) -> int:
        """The policy version of the weights in use."""
        return self._version

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
        flight = self._flights[request_id] = _Flight()
        self._mark_busy()
        tokens: list[int] = []
        logprobs: list[float] = []
        arrival_versions: list[int] = []
        finish: str | None = None
        spans: Any = None
        try:
            stream = engine.generate(prompt, self._vllm_params(params), request_id)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    completion = out.outputs[0]
                    new_tokens = [int(t) for t in completion.token_ids]
                    tokens += new_tokens
                    arrival_versions += [self._version] * len(new_tokens)
                    logprobs += _sampled_logprobs(new_tokens, completion.logprobs)
                    self._generated_tokens += len(new_tokens)
                    if out.finished:
                        finish, spans = completion.finish_reason, getattr(completion, "weight_versions", None)
                        break
                    if flight.aborted:
                        # Aborted before vLLM knew the request: leaving the stream aborts it (aclosing).
                        finish = "abort"
                        break
        except EngineDeadError as error:
            raise EngineClosed(f"vLLM's engine died during request {request_id!r}") from error
        finally:
            del self._flights[request_id]
            self._mark_idle()
        reason = _FINISH_REASONS.get(str(finish)) if finish is not None else "abort"
        if reason is None:
            raise VLLMRequestFailed(f"vLLM ended request {request_id!r} with finish_reason {finish!r}")
        return GenerationResult(
            token_ids=tokens,
            logprobs=logprobs,
            versions=_span_versions(spans, len(tokens)) or arrival_versions,
            finish_reason=reason,
            prompt_tokens=len(prompt_ids),
        )

    @staticmethod
    def _vllm_params(params: SamplingParams) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams  # type: ignore[import-not-found,unused-ignore]
        from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found,unused-ignore]

        greedy = params.temperature == 0
        # Every field that shapes the distribution is set, so the log-probs are the behaviour policy's.
        return VLLMSamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            seed=None if greedy else params.seed,
            stop_token_ids=list(params.stop_token_ids),
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if not all(0 <= token < self._vocab_size for token in prompt_ids):
            raise InvalidRequest(f"the prompt has token ids outside the vocabulary [0, {self._vocab_size})")
        if params.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise InvalidRequest(f"need temperature >= 0 and 0 < top_p <= 1, got {params.temperature}, {params.top_p}")
        if len(prompt_ids) + params.max_tokens > self._max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's "
                f"max_model_len {self._max_model_len}"
            )

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its `generate` returns with finish_reason 'abort'. False when it is not in flight."""
        flight = self._flights.get(request_id)
        if flight is None or self._engine is None:
            return False
        flight.aborted = True
        await self._engine.abort(request_id)
        return True

    def _mark_busy(self) -> None:
        if self._busy_since is None:
            self._busy_since = time.monotonic()
        self._drained.clear()

    def _mark_idle(self) -> None:
        if not self._flights:
            if self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
            self._drained.set()

    # ---------------------------------------------------------------- weights

    async def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Load `weights` (HF names, as `state_dict()` gives) into the running engine as `version`.

        Requests in flight keep going: the steps after the swap run the new weights and their tokens say so.
        With tied embeddings `lm_head.weight` may be left out (it is sent as a copy of the embeddings)."""
        async with self._weights_lock:
            engine = self._running_engine()
            if version <= self._version:
                raise InvalidRequest(f"weights version {version} is not newer than version {self._version}")
            assert self._staging is not None
            started = time.monotonic()
            tensors = await asyncio.to_thread(self._checked_tensors, version, weights)
            staged = self._staging / "model.safetensors"
            await asyncio.to_thread(_save_safetensors, tensors, staged)
            try:
                # Sent back to back, in this order (gather starts its tasks in order and each sends before it
                # waits): the engine core runs all three between two steps, so no step runs the new weights
                # under the old label.
                _, _, reset = await asyncio.gather(
                    engine.collective_rpc("reload_weights", kwargs={"weights_path": str(self._staging)}),
                    engine.update_weight_version(str(version)),
                    engine.reset_prefix_cache(),
                )
            finally:
                staged.unlink(missing_ok=True)
            self._version = version
            log.info(
                "vllm weights loaded",
                version=version,
                tensors=len(tensors),
                seconds=round(time.monotonic() - started, 3),
                prefix_cache_reset=bool(reset),
            )

    def _checked_tensors(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Check names and shapes against the checkpoint the engine loaded; add the tied lm_head; CPU copies."""
        import torch

        expected = self._checkpoint_shapes
        aliases = {_TIED_NAME: _EMBED_NAME} if self._tied and _EMBED_NAME in expected else {}
        problems = []
        if expected:
            missing = [name for name in expected if name not in weights and name not in aliases]
            unexpected = [name for name in weights if name not in expected and name not in aliases]
            wrong_shape = [
                f"{name} {tuple(tensor.shape)} (model: {expected[name]})"
                for name, tensor in weights.items()
                if name in expected and tuple(tensor.shape) != expected[name]
            ]
            if missing:
                problems.append(f"missing: {_describe(missing)}")
            if unexpected:
                problems.append(f"unexpected: {_describe(unexpected)}")
            if wrong_shape:
                problems.append(f"wrong shape: {_describe(wrong_shape)}")
        for alias, name in aliases.items():
            given_both = alias in weights and name in weights and weights[alias] is not weights[name]
            if given_both and not torch.equal(weights[alias], weights[name]):
                problems.append(f"{alias} is tied to {name} in this model but differs from it")
        if problems:
            raise WeightsMismatch(f"weights for version {version} do not match the model: " + "; ".join(problems))
        # safetensors wants contiguous CPU tensors that share no storage (the tied pair included).
        tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights.items()}
        for alias, name in aliases.items():
            if alias not in tensors:
                tensors[alias] = tensors[name].clone()
        return tensors

    # ---------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        """How busy the engine is. vLLM runs up to `max_batch_size` requests at once and queues the rest; it does
        not say which are which without its stats loggers, so running/waiting split the requests vLLM holds at
        that cap (KV-cache pressure can queue more)."""
        now = time.monotonic()
        elapsed = now - self._started_at if self._started_at else 0.0
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        in_flight = int(self._engine.get_num_unfinished_requests()) if self._engine is not None else 0
        return EngineLoad(
            running=min(in_flight, self._max_batch_size),
            waiting=max(0, in_flight - self._max_batch_size),
            busy_fraction=min(1.0, busy / elapsed) if elapsed > 0 else 0.0,
            generated_tokens=self._generated_tokens,
            version=self._version,
        )


def _sampled_logprobs(tokens: list[int], position_logprobs: Any) -> list[float]:
    """The sampled token's log-prob at each position (`logprobs=0` asks vLLM for exactly that one)."""
    if position_logprobs is None:
        raise VLLMRequestFailed("vLLM returned no log-probs (logprobs=0 was asked for)")
    return [float(entries[token].logprob) for token, entries in zip(tokens, position_logprobs, strict=True)]


def _span_versions(spans: Any, n_tokens: int) -> list[int] | None:
    """Per-token versions from vLLM's `weight_versions` spans; None when absent, unlabelled or not covering all."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        try:
            label = int(span.version)
        except ValueError:
            return None
        versions += [label] * (int(span.end) - int(span.start))
    return versions if len(versions) == n_tokens else None


def _checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model folder's safetensors files (headers only); empty if there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    return shapes


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
