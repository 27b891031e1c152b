"""The generation backends by name (`run.generator.backend`): what each needs and can do, how a generator spec is
checked against it, and how a generator node's engines are built.

A backend is one record in `GENERATION_BACKENDS`. Nodes, topology checks, GPU placement, the launcher and the CLI
ask a record (does it shard a model, hand KV cache on, take pushed weights, live in its own virtual environment,
run on modelled hardware) instead of comparing names, so a new backend is its folder under
`rollart/generation/` and its line here. A record's builder imports its backend (torch, vLLM) only when called:
this module imports neither, and the topology reads it. Imports run one way: this registry -> a backend -> the
engine protocol and the shared machinery (`checks`, `engine_set`, `kv_store`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollart.errors import ConfigError
from rollart.generation.config import GeneratorSpec

if TYPE_CHECKING:
    from rollart.generation.engine import GenerationEngine
    from rollart.lora.spec import LoraSpec
    from rollart.sim.config import SimSpec


@dataclass(frozen=True)
class EngineSlot:
    """Where one engine of a generator node runs."""

    gpus: Sequence[str] = ()
    """Its GPUs, as CUDA numbers them for the node's processes (empty on CPU)."""
    cores: Sequence[int] = ()
    """Its share of the node's cores (empty: not pinned)."""
    device: str = "cpu"
    """The torch device of a backend that runs in the node's process."""


@dataclass(frozen=True)
class EngineSite:
    """What a generator node's engines are built for: the model, where each engine runs, and the run's settings
    a backend may need."""

    model_path: str
    dtype: str
    """The dtype the engines run floating-point weights in (`run.generator.dtype` resolved)."""
    slots: Sequence[EngineSlot]
    hardware: str
    """The node's hardware class (a simulated engine is shaped by `run.sim.engines[hardware]`)."""
    lora: LoraSpec | None
    sim: SimSpec


@dataclass(frozen=True)
class OwnVenv:
    """A virtual environment a backend's library lives in, beside the node's (its pins would clash)."""

    module: str
    """The module that is importable there (and, when it is importable here, nothing is set up)."""
    folder: str
    """The environment's folder under the repository root."""
    setup: str
    """The script that makes it, from the repository root."""
    override_env: str
    """The environment variable that names another folder for it."""
    doc: str
    """Where a user reads about it."""


@dataclass(frozen=True)
class GenerationBackend:
    """What a generation backend needs and can do, and how to build a node's engines."""

    build: Callable[[GeneratorSpec, EngineSite], list[GenerationEngine]]
    """The node's engines, one per slot (a modelled backend: one engine standing for all its replicas)."""
    simulated: bool = False
    """Modelled hardware (`run.sim`): no model runs, no GPU is used, no weights are pushed (`SimWeights` stands for
    the push); the in-process launcher runs only such engines."""
    shards: bool = False
    """An engine may shard its model over GPUs (`tensor_parallel_size` > 1)."""
    kv_handoff: bool = False
    """A prefilled prompt's KV cache can go from one engine to the one that decodes it (`routing: disaggregated`)."""
    kv_store: bool = False
    """...through a folder every generator reaches (`generator.kv_store`), which it then needs."""
    takes_visible_gpus: bool = False
    """Runs on the GPUs `CUDA_VISIBLE_DEVICES` names even when the topology gives the node none."""
    pins_after_start: bool = False
    """Its engine starts worker processes on every core; the node pins the whole process tree to its share once
    the engine is up (`rollart.cpus.pin_tree`), rather than pinning itself before."""
    venv: OwnVenv | None = None
    """The environment its library lives in; None: the node's own."""
    shared_weights: bool = False
    """Its engine's workers are processes of their own that map a pushed version from shared memory: the
    receiver places buckets there (`WeightReceiver(shared=True)`), so a version reaches every worker of every
    engine on the host with no copy in between (`rollart.shm`)."""

    @property
    def pushed_weights(self) -> bool:
        """Generators of this backend receive the trainer's weights over the weight path."""
        return not self.simulated


def backend(name: str) -> GenerationBackend:
    """The record of `run.generator.backend: name` (the topology's type admits only known names)."""
    if (record := GENERATION_BACKENDS.get(name)) is None:
        hint = difflib.get_close_matches(name, GENERATION_BACKENDS, n=1)
        known = ", ".join(sorted(GENERATION_BACKENDS))
        raise ConfigError(
            f"run.generator.backend: unknown generation backend {name!r} (known: {known})"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
        )
    return record


def check(spec: GeneratorSpec) -> list[tuple[str, str]]:
    """(field of `run.generator`, problem) for what `spec` asks of its backend that the backend cannot do."""
    record = backend(spec.backend)
    problems = []
    if spec.tensor_parallel_size > 1 and not record.shards:
        problems.append(
            ("tensor_parallel_size", f"only the {_which('shards')} backend shards a model; backend is {spec.backend}")
        )
    if spec.kv_store is not None and not record.kv_store:
        problem = f"only the {_which('kv_store')} backend hands KV cache on; backend is {spec.backend}"
        problems.append(("kv_store", problem))
    if record.simulated and spec.engines > 1:
        problems.append(("engines", f"the {spec.backend} backend models its replicas with run.sim; expected 1"))
    return problems


def _which(capability: str) -> str:
    return ", ".join(name for name, record in GENERATION_BACKENDS.items() if getattr(record, capability))


# -- the backends -------------------------------------------------------------------------------

VLLM_VENV = OwnVenv(
    module="vllm", folder=".venv-vllm", setup="bin/setup-vllm", override_env="ROLLART_VLLM_VENV", doc="docs/vllm.md"
)


def _vllm(spec: GeneratorSpec, site: EngineSite) -> list[GenerationEngine]:
    import importlib.util

    if importlib.util.find_spec(VLLM_VENV.module) is None:
        raise ConfigError(
            f"run.generator.backend: {VLLM_VENV.module} is not installed in this environment; run {VLLM_VENV.setup} "
            f"and start the nodes with {VLLM_VENV.folder}/bin/python ({VLLM_VENV.doc}), or use backend: hf"
        )
    from rollart import cpus
    from rollart.generation.vllm.engine import VLLMEngine

    return [
        VLLMEngine(
            site.model_path,
            max_batch_size=spec.max_num_seqs,
            dtype=site.dtype,
            kv_cache_gb=spec.kv_cache_gb,
            cpu_threads_bind=cpus.cpu_list(slot.cores) if slot.cores else None,
            enforce_eager=spec.enforce_eager,
            tensor_parallel_size=spec.tensor_parallel_size,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            max_model_len=spec.max_model_len,
            cuda_devices=",".join(slot.gpus) if slot.gpus else None,
            lora=site.lora,
            kv_store=spec.kv_store,
        )
        for slot in site.slots
    ]


def _hf(spec: GeneratorSpec, site: EngineSite) -> list[GenerationEngine]:
    import torch

    from rollart.generation.hf.engine import HFEngine

    dtype = getattr(torch, site.dtype)
    return [
        HFEngine(site.model_path, max_batch_size=spec.max_num_seqs, dtype=dtype, device=slot.device)
        for slot in site.slots
    ]


def _sim(spec: GeneratorSpec, site: EngineSite) -> list[GenerationEngine]:
    from rollart.generation.sim import build_sim_engine

    return [build_sim_engine(site.sim, site.hardware, tokenizer_path=site.model_path, max_batch_size=spec.max_num_seqs)]


GENERATION_BACKENDS: dict[str, GenerationBackend] = {
    "vllm": GenerationBackend(
        _vllm,
        shards=True,
        kv_handoff=True,
        kv_store=True,
        takes_visible_gpus=True,
        pins_after_start=True,
        venv=VLLM_VENV,
        shared_weights=True,
    ),
    "hf": GenerationBackend(_hf),
    "sim": GenerationBackend(_sim, simulated=True, kv_handoff=True),
}
"""`run.generator.backend` -> its record (`GeneratorSpec.backend`'s type lists the same names)."""
