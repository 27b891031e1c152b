"""What the vLLM engine asks of vLLM and reads back: engine arguments and their environment, sampling parameters,
and the log-probs, finish reasons and weight-version spans of its outputs.

vLLM is imported inside the functions that need it (it lives in its own virtual environment; docs/vllm.md), so
importing this module works without it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollart import cpus
from rollart.errors import RollartError
from rollart.generation.engine import FinishReason, SamplingParams
from rollart.generation.kv_store import KV_ARG
from rollart.generation.vllm.worker import EXTENSION as WORKER_EXTENSION

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("rollart.generation.vllm")

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
"""vLLM's finish reasons that RollArt has; any other ends the request with `VLLMRequestFailed`."""
CPU_KV_CACHE_GB = 1.0
"""KV cache of an engine on CPU when `run.generator.kv_cache_gb` is not given (vLLM would take a quarter of RAM)."""
_ENV_LOCK = threading.Lock()
"""vLLM reads its CPU settings from the environment of the process it spawns: one engine start at a time edits it."""


class VLLMRequestFailed(RollartError):
    """vLLM ended a request with an error of its own (finish_reason 'error' or an unknown reason)."""


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How to start vLLM's engine; `VLLMEngine.__init__` says what each setting means."""

    model_path: Path
    max_batch_size: int
    dtype: str | torch.dtype
    kv_cache_gb: float | None
    cpu_threads_bind: str | None
    enforce_eager: bool | None
    seed: int
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    """Tokens one engine step computes at most (vLLM's chunked-prefill budget; None: vLLM's default)."""
    cuda_devices: str | None = None
    max_lora_rank: int | None = None
    """None: no LoRA; else vLLM serves LoRA adapters up to this rank (one of vLLM's allowed ranks)."""
    max_loras: int = 1
    """LoRA adapters one batch may mix."""
    max_cpu_loras: int | None = None
    """LoRA adapters vLLM keeps loaded (None: `max_loras`)."""
    kv_store: Path | None = None
    """None: no KV handoff; else the folder the KV store connector writes prefilled prompts to and reads them
    from (`rollart.generation.vllm.kv_connector`)."""


def create_engine(settings: EngineSettings, created: list[Any]) -> None:
    """Start vLLM's `AsyncLLM` and append it to `created` (blocks until its engine-core process is up: run it in a
    thread; `VLLMEngine.start` says why the engine is not returned)."""
    from vllm import AsyncEngineArgs  # type: ignore[import-not-found,unused-ignore]
    from vllm.platforms import current_platform  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]

    on_cpu = bool(current_platform.is_cpu())
    env: dict[str, str | None] = {}
    kv_cache_gb = settings.kv_cache_gb
    if on_cpu:
        kv_cache_gb = CPU_KV_CACHE_GB if kv_cache_gb is None else kv_cache_gb
        env["VLLM_CPU_KVCACHE_SPACE"] = None  # the legacy variable would override kv_cache_memory_bytes
    elif settings.cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = settings.cuda_devices  # this engine's slice of the node's GPUs
    if on_cpu and (settings.cpu_threads_bind is not None or settings.tensor_parallel_size > 1):
        # An explicit core list, one per worker ("0-3|4-7"); vLLM then reserves no core of its own (with "auto" it
        # keeps one for its scheduler process, which on 2 shared cores ran 16 x 32 tokens 5x faster than using
        # both). It refuses "auto" for more workers than NUMA nodes, and one list for several workers.
        env["VLLM_CPU_OMP_THREADS_BIND"] = worker_threads_bind(settings.cpu_threads_bind, settings.tensor_parallel_size)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    enforce_eager = on_cpu if settings.enforce_eager is None else settings.enforce_eager
    kv_cache_bytes = None if kv_cache_gb is None else int(kv_cache_gb * 2**30)
    lora: dict[str, Any] = {}
    if settings.max_lora_rank is not None:  # pushed versions are LoRA adapters (rollart.generation.vllm.lora)
        lora = {
            "enable_lora": True,
            "max_lora_rank": settings.max_lora_rank,
            "max_loras": settings.max_loras,
            "max_cpu_loras": settings.max_cpu_loras,
        }
    kv: dict[str, Any] = {}
    if settings.kv_store is not None:
        from vllm.config import KVTransferConfig  # type: ignore[import-not-found,unused-ignore]

        kv["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RollartKVStore",
            kv_connector_module_path="rollart.generation.vllm.kv_connector",
            kv_role="kv_both",  # a generator may serve either half, as the proxy routes
            kv_connector_extra_config={"shared_storage_path": str(settings.kv_store)},
        )
    args = AsyncEngineArgs(
        model=str(settings.model_path),
        dtype=settings.dtype,  # type: ignore[arg-type,unused-ignore]
        seed=settings.seed,
        max_num_seqs=settings.max_batch_size,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_bytes,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        disable_log_stats=True,
        # New weights arrive through a method of ours in vLLM's worker (rollart.generation.vllm.worker).
        worker_extension_cls=WORKER_EXTENSION,
        **lora,
        **kv,
    )
    with _environ(env):
        created.append(AsyncLLM.from_engine_args(args))


def worker_threads_bind(cores: str | None, workers: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for an engine of `workers` CPU workers on `cores` (a CPU list; None: the cores
    this process may run on): one CPU list per worker, separated by `|`."""
    given = cpus.parse_cpu_list(cores) if cores is not None else tuple(sorted(os.sched_getaffinity(0)))
    shares = cpus.per_worker(given, workers)
    if len(given) < workers:
        log.warning(
            "vllm workers share cores", workers=workers, cores=cpus.cpu_list(given), why="fewer cores than workers"
        )
    return "|".join(cpus.cpu_list(share) for share in shares)


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


def vllm_sampling_params(params: SamplingParams, kv: tuple[str, str] | None = None) -> Any:
    """vLLM's sampling parameters for `params`: token ids out, one log-prob per sampled token, streamed as deltas.
    `kv`: what it asks of the KV store (`KVStore.handoff`); a prefill half generates one token, which its caller
    drops."""
    from vllm import SamplingParams as VLLMSamplingParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found,unused-ignore]

    greedy = params.temperature == 0
    # Every field that shapes the distribution is set, so the log-probs are the behaviour policy's.
    return VLLMSamplingParams(
        max_tokens=1 if params.prefill_only else params.max_tokens,
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
        extra_args=None if kv is None else {KV_ARG: list(kv)},
    )


def sampled_logprobs(tokens: list[int], position_logprobs: Any) -> list[float]:
    """The sampled token's log-prob at each position (`logprobs=0` asks vLLM for exactly that one)."""
    if position_logprobs is None:
        raise VLLMRequestFailed("vLLM returned no log-probs (logprobs=0 was asked for)")
    return [float(entries[token].logprob) for token, entries in zip(tokens, position_logprobs, strict=True)]


def span_versions(spans: Any, n_tokens: int) -> list[int] | None:
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
