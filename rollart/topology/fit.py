"""Whether each node of a topology fits the hardware it declares: `size_topology` for `rollart check`.

The policy's shape comes from the checkpoint's config.json at `run.model.path`, else from the
`run.model.shape` preset; without either nothing is sized. Each trainer and generator node gets the
estimate of `rollart.topology.sizing` against its GPUs (`resources.gpu_type` or `gpu_memory_gb`; per
GPU) or, without GPUs, its `resources.memory_gb` (per node). A node that does not fit is a problem
(YAML path, message) naming what it needs, what its GPUs hold, and the changes that would make it fit,
worked out with the same estimates: a larger `tensor_parallel_size` or a lower `max_model_len` for a
generator, more ranks, activation checkpointing, a smaller micro-batch or a bf16 master for a trainer.
Nothing here runs at load time: a topology whose estimate is off still starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollart.generation.registry import backend as generation_backend
from rollart.models.presets import preset
from rollart.models.shapes import ModelShape, ShapeError, read_shape
from rollart.topology import NodeSpec, Topology
from rollart.topology.gpus import canonical_kind, gpu_memory_gib, plan_gpus
from rollart.topology.roles import Role
from rollart.topology.sizing import (
    CPU_KV_CACHE,
    GIB,
    TRAINER_USABLE,
    engine_activations,
    engine_dtype,
    engine_need,
    group_ranks,
    longest_task,
    micro_batch_tokens,
    trainer_activations,
    trainer_states,
)


@dataclasses.dataclass
class NodeSize:
    """One node's estimate in bytes per device (`per`: GPU, or the whole node on CPU) and its verdict."""

    index: int
    node: NodeSpec
    ids: tuple[int, ...]
    kind: str | None = None
    gpu_gib: float | None = None
    weights: float | None = None
    grads_optim: float | None = None
    activations: float | None = None
    kv: float | None = None
    usable: float | None = None
    usable_text: str = "-"
    notes: list[str] = dataclasses.field(default_factory=list)
    problem: tuple[str, str] | None = None

    @property
    def per(self) -> str:
        return "GPU" if self.node.resources.gpus else "node"

    @property
    def need(self) -> float | None:
        parts = [p for p in (self.weights, self.grads_optim, self.activations, self.kv) if p is not None]
        return sum(parts) if parts else None

    @property
    def verdict(self) -> str:
        if self.problem is not None:
            return "NO FIT"
        return "-" if self.usable is None or self.need is None else "ok"

    def holds(self) -> str:
        """What the node's devices hold, in words, for a problem's message."""
        if self.node.resources.gpus:
            return f"its {self.kind or 'GPU'} holds {self.usable_text} GiB usable"
        return f"it is given {self.usable_text} GiB"


@dataclasses.dataclass
class Sizing:
    """The model's shape (or why there is none) and every node's estimate."""

    shape: ModelShape | None
    source: str
    nodes: list[NodeSize]

    @property
    def problems(self) -> list[tuple[str, str]]:
        return [size.problem for size in self.nodes if size.problem is not None]


def resolve_shape(topology: Topology) -> tuple[ModelShape | None, str]:
    """The policy's shape and where it came from: the checkpoint's config.json, else `run.model.shape`."""
    model = topology.run.model
    folder = Path(model.path)
    if (folder / "config.json").exists():
        try:
            return read_shape(folder), str(folder / "config.json")
        except (ShapeError, OSError) as exc:
            return None, f"cannot size the model: {exc}"
    if model.shape is not None and (shape := preset(model.shape)) is not None:
        return shape, f"run.model.shape {model.shape}, no config.json in {folder} yet"
    built = " (the tiny model is built there on first use)" if model.build_tiny_if_missing else ""
    return None, f"no config.json in {folder} yet{built}; set run.model.shape to size the nodes before"


def size_topology(topology: Topology) -> Sizing:
    """Every node's memory estimate against its declared GPUs (or `memory_gb` on CPU)."""
    shape, source = resolve_shape(topology)
    plan = plan_gpus(topology)
    sizes = []
    for i, node in enumerate(topology.nodes):
        res = node.resources
        kind = (canonical_kind(res.gpu_type) or res.gpu_type) if res.gpu_type is not None else None
        size = NodeSize(i, node, plan[node.name], kind, gpu_memory_gib(res.gpu_type, res.gpu_memory_gb))
        if node.role in (Role.ENV_HOST, Role.REWARD_GATEWAY):
            size.notes.append("holds no policy model")
        elif shape is not None and node.role is Role.TRAINER:
            _trainer(topology, size, shape)
        elif shape is not None:
            _generator(topology, size, shape)
        if res.gpus and size.gpu_gib is None and size.need is not None:
            size.notes.append("GPU kind not given: set resources.gpu_type (or gpu_memory_gb) for a verdict")
        sizes.append(size)
    return Sizing(shape, source, sizes)


def _set_usable(size: NodeSize, fraction: float) -> None:
    """What the node's devices hold: `fraction` of each GPU, or its memory_gb on CPU (None: unknown)."""
    res = size.node.resources
    if res.gpus and size.gpu_gib is not None:
        size.usable = fraction * size.gpu_gib * GIB
        size.usable_text = f"{size.gpu_gib:.1f} x {fraction:.2f} = {size.usable / GIB:.1f}"
    elif not res.gpus and res.memory_gb is not None:
        size.usable = res.memory_gb * GIB
        size.usable_text = f"{res.memory_gb:g} (memory_gb)"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def _trainer(topology: Topology, size: NodeSize, shape: ModelShape) -> None:
    rollout = topology.run.rollout
    if rollout is None or rollout.mode != "train":
        size.notes.append("does not train (rollout-only, or no run.rollout)")
        return
    spec, node = topology.run.trainer, size.node
    weights, states, how = trainer_states(topology, node, shape)
    tokens = micro_batch_tokens(topology)
    activations = trainer_activations(topology, node, shape, tokens)
    ranks_here = 1 if node.resources.gpus else spec.ranks  # on CPU the node's ranks add up
    size.weights, size.grads_optim, size.activations = (x * ranks_here for x in (weights, states, activations))
    checkpointing = "activation checkpointing" if spec.activation_checkpointing else "no activation checkpointing"
    size.notes.append(f"{how}; micro-batch {tokens} tokens, {checkpointing}")
    _set_usable(size, TRAINER_USABLE if node.resources.gpus else 1.0)
    if size.usable is None or size.need is None or size.need <= size.usable:
        return
    ideas = []
    lighter = trainer_activations(topology, node, shape, tokens, checkpointing=True)
    if not spec.activation_checkpointing:
        ideas.append(f"activation_checkpointing: true (activations {_gib(lighter * ranks_here)} GiB)")
    if node.resources.gpus and spec.backend in ("torch", "fsdp2"):
        world = group_ranks(topology, node)
        states_one = (weights + states) * world  # what one rank would hold alone; fsdp2 divides it by the ranks
        more = next(
            (n for n in (2**k for k in range(1, 11)) if n > world and states_one / n + lighter <= size.usable), 0
        )
        if more:
            via = "backend fsdp2 with" if spec.backend == "torch" else "more ranks:"
            with_ac = " with activation checkpointing" if not spec.activation_checkpointing else ""
            ideas.append(f"{via} {more} ranks in the group ({_gib(states_one / more + lighter)} GiB per GPU{with_ac})")
    if tokens > 2048:
        ideas.append(f"a smaller micro-batch (micro_batch_tokens; now {tokens} tokens)")
    if spec.master_dtype == "fp32":
        ideas.append("master_dtype: bf16 (half the weights and optimizer state)")
    problem = (
        f"trainer {node.name} needs {_gib(size.need)} GiB per {size.per} (weights {_gib(size.weights)}, "
        f"gradients and optimizer {_gib(size.grads_optim)}, activations {_gib(size.activations)}); "
        f"{size.holds()}: try " + ", or ".join(ideas)
    )
    size.problem = (f"nodes[{size.index}].resources.{'gpus' if node.resources.gpus else 'memory_gb'}", problem)


def _generator(topology: Topology, size: NodeSize, shape: ModelShape) -> None:
    gen, node = topology.run.generator, size.node
    if generation_backend(gen.backend).simulated:
        size.notes.append("simulated engine (run.sim)")
        return
    on_gpu = node.resources.gpus > 0
    dtype = engine_dtype(topology, shape, on_gpu=on_gpu)
    if not on_gpu:  # each engine a whole copy in the node's memory
        kv = gen.kv_cache_gb * GIB if gen.kv_cache_gb is not None else CPU_KV_CACHE
        size.weights = shape.weight_bytes(dtype) * gen.engines
        size.activations = engine_activations(topology, shape, dtype, 1, on_gpu=False) * gen.engines
        size.kv = kv * gen.engines
        size.notes.append(f"{gen.engines} engine(s) on CPU, {dtype}, KV cache {_gib(kv)} GiB each")
        _set_usable(size, 1.0)
        if size.usable is not None and size.need is not None and size.need > size.usable:
            problem = f"generator {node.name} needs {_gib(size.need)} GiB; {size.holds()}: give it more memory_gb"
            size.problem = (f"nodes[{size.index}].resources.memory_gb", problem)
        return
    tp = gen.tensor_parallel_size
    max_len = gen.max_model_len or shape.max_position_embeddings
    kv_token = shape.kv_bytes_per_token(dtype, tp)
    size.weights, size.activations, one_sequence = engine_need(topology, shape, dtype, tp, max_len)
    pool = gen.kv_cache_gb * GIB / tp if gen.kv_cache_gb is not None else None
    size.kv = pool if pool is not None else one_sequence
    _set_usable(size, gen.gpu_memory_utilization)
    line = (
        f"{gen.engines} engine(s) x tp {tp}, {dtype}, max_model_len {max_len}, KV {kv_token / 1024:.0f} KiB/token/GPU"
    )
    if size.usable is not None:
        room = pool if pool is not None else size.usable - size.weights - size.activations
        longest = longest_task(topology)
        seqs = max(0, int(room // (kv_token * longest)))
        line += f"; KV room for {seqs} sequences of {longest} tokens at once (max_num_seqs {gen.max_num_seqs})"
        line += "" if seqs >= gen.max_num_seqs else ": the rest of a full batch waits, or is preempted"
    size.notes.append(line)
    if size.usable is None or size.need is None:
        return
    if pool is not None and pool < one_sequence:
        problem = (
            f"generator {node.name}: run.generator.kv_cache_gb {gen.kv_cache_gb:g} holds {int(pool // kv_token)} "
            f"tokens per engine, fewer than one {max_len}-token sequence: raise it, or lower max_model_len"
        )
        size.problem = ("run.generator.kv_cache_gb", problem)
    elif size.need > size.usable:
        size.problem = (f"nodes[{size.index}].resources.gpus", _engine_advice(topology, size, shape, dtype, max_len))


def _engine_advice(topology: Topology, size: NodeSize, shape: ModelShape, dtype: str, max_len: int) -> str:
    """Why a generator's engines do not fit, and what would make them (same estimates, other settings)."""
    gen, usable = topology.run.generator, size.usable or 0.0
    weights, activations = size.weights or 0.0, size.activations or 0.0
    ideas = []
    for tp in (2, 4, 8):
        if tp > gen.tensor_parallel_size and sum(engine_need(topology, shape, dtype, tp, max_len)) <= usable:
            need = sum(engine_need(topology, shape, dtype, tp, max_len))
            ideas.append(
                f"tensor_parallel_size: {tp} ({_gib(need)} GiB per GPU; the node then needs "
                f"engines x {tp} = {gen.engines * tp} GPUs)"
            )
            break
    kv_token = shape.kv_bytes_per_token(dtype, gen.tensor_parallel_size)
    if (fits := int((usable - weights - activations) // kv_token) // 1024 * 1024) >= 1024:
        ideas.append(f"max_model_len: {fits} (KV is {kv_token / 1024:.0f} KiB per token per GPU)")
    ideas.append("a GPU with more memory")
    return (
        f"generator {size.node.name} needs {_gib(size.need)} GiB per GPU for weights ({_gib(weights)}), "
        f"activations ({_gib(activations)}) and one {max_len}-token sequence ({_gib(size.kv)}); "
        f"{size.holds()}: try " + ", or ".join(ideas)
    )
