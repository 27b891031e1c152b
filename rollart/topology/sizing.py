"""How much memory a trainer rank and a generator engine need: the estimates behind `rollart check`.

Everything here is an **estimate** from the model's shape (`rollart.models.shapes`: its config.json, or
the `run.model.shape` preset) and the topology; allocator fragmentation, kernels' workspaces and library
versions move real figures by a few GiB. Bytes are per device (per GPU, or per node on CPU). With P the
parameters, L layers, h hidden, I intermediate, V the vocabulary:

Trainer (per rank; `run.trainer`):
  weights + gradients + AdamW state: P x (4 + 4 + 8) B with an fp32 master (weights, gradients, two
    moments), P x (2 + 2 + 4) B with `master_dtype: bf16`; megatron keeps bf16 weights, fp32 gradients
    and an fp32 master copy in its optimizer: P x (2 + 4 + 12) B.
  sharding: torch, none; fsdp2, all of it over the group's ranks (plus two gathered layers in the
    compute dtype, the one computing and the one prefetched); megatron, weights and gradients over
    tensor x pipeline parallel, the optimizer state also over data parallel (the distributed optimizer).
  a reference model (`grpo.kl_coef` > 0): P x 2 B more, sharded as the weights.
  activations of one micro-batch of T tokens (`micro_batch_tokens`, else `micro_batch_size` x the
    longest task's `max_total_tokens`), b bytes per element (2 in bf16, 4 in fp32): without
    checkpointing T x L x (10h + 4I) x b (what one decoder layer keeps for its backward pass: norms,
    q/k/v, attention output, the SwiGLU MLP's four I-wide tensors); with `activation_checkpointing`
    T x L x h x b (each layer's input) + T x (10h + 4I) x b (the layer being recomputed); plus the
    logits of one chunk and their gradient, 2 x C x V x 4 B (C: `logprob_chunk_tokens`, 0: all T);
    megatron divides activations by tensor parallel (sequence parallel). Megatron, without Transformer
    Engine, has no chunked log-probs (C = T) and unfused attention, whose every layer keeps its scores'
    softmax in fp32 and the probabilities in the compute dtype for the backward pass: (T / S) rows x
    heads x S^2 x (4 + b) B a layer (S: the longest task's `max_total_tokens`), one layer's with
    checkpointing. Measured on an H200 (Qwen3-1.7B shape, bf16, S = 1024): 16,384 tokens a micro-batch
    ran out of 140 GiB, 4,096 ran (benchmarks/results/gpu/README.md); this estimate gives 128 and 54 GiB.
  usable: 90% of the GPU (the rest: CUDA context, NCCL buffers, allocator slack; an assumption).
Generator engine (per GPU of one engine; `run.generator`):
  weights: P x dtype bytes / tensor_parallel_size (dtype auto: the checkpoint's).
  KV cache per token: 2 x L x ceil(kv_heads / tp) x head_dim x dtype bytes; an engine must hold at
    least one `max_model_len`-token sequence (None: the model's max_position_embeddings), and ideally
    `max_num_seqs` sequences of the tasks' `max_total_tokens`.
  activations: 1 GiB (CUDA graphs and context) + a forward of 8192 batched tokens (vLLM's
    max_num_batched_tokens), 8192 x (4h + 3I / tp) x dtype bytes, + max_num_seqs x V x 4 B of logits.
  usable: `gpu_memory_utilization` x the GPU. It fits when weights + activations + one sequence's KV
    fit; the rest is KV cache (or `kv_cache_gb`, when set), and `rollart check` says how many
    sequences of the longest task it holds at once.
CPU nodes (no GPUs) are sized per node (a trainer's ranks and a generator's engines added up, an
engine's KV cache `kv_cache_gb` or vLLM's 1 GiB on CPU) against `resources.memory_gb` when given, else
reported without a verdict. Env-hosts and reward gateways hold no policy model.

This module computes the figures; `rollart.topology.fit` compares them with each node's GPUs and words
the verdicts, and `rollart.topology.table` prints them.
"""

from __future__ import annotations

from rollart.models.shapes import ModelShape, dtype_bytes
from rollart.topology import NodeSpec, Topology

GIB = 1024**3
TRAINER_USABLE = 0.90
"""Fraction of a GPU a trainer rank may fill (an assumption: CUDA context, NCCL buffers, allocator slack)."""
ENGINE_FIXED = 1 * GIB
"""An engine's CUDA graphs and context."""
ENGINE_BATCH_TOKENS = 8192
"""Tokens in one engine forward (vLLM's max_num_batched_tokens), whose activations it profiles."""
CPU_KV_CACHE = 1 * GIB
"""vLLM's KV cache on CPU when `kv_cache_gb` is not set."""
DEFAULT_TOTAL_TOKENS = 1024


def longest_task(topology: Topology) -> int:
    """The longest `max_total_tokens` of the run's tasks (1024 without tasks)."""
    tasks = topology.run.rollout.tasks if topology.run.rollout is not None else []
    return max((task.max_total_tokens for task in tasks), default=DEFAULT_TOTAL_TOKENS)


def micro_batch_tokens(topology: Topology) -> int:
    """Tokens of one training micro-batch: `micro_batch_tokens`, else sequences x the longest task."""
    spec = topology.run.trainer
    return spec.micro_batch_tokens or spec.micro_batch_size * longest_task(topology)


def group_ranks(topology: Topology, node: NodeSpec) -> int:
    """Ranks of trainer `node`'s whole group: `run.trainer.ranks` per node of it."""
    return topology.run.trainer.ranks * len(topology.trainer_group(node.name))


def trainer_states(
    topology: Topology, node: NodeSpec, shape: ModelShape, *, world: int | None = None, master: str | None = None
) -> tuple[float, float, str]:
    """Bytes per rank of trainer `node` for (weights, gradients + optimizer state), and how they are
    held; `world` and `master` try another group size or master dtype than the topology's."""
    spec, params = topology.run.trainer, shape.params()
    world = world or group_ranks(topology, node)
    if (master or spec.master_dtype) == "bf16":
        w, g, o, what = 2, 2, 4, "bf16 weights, gradients and AdamW moments (8 B/parameter)"
    elif spec.backend == "megatron":
        w, g, o, what = 2, 4, 12, "bf16 weights, fp32 gradients, fp32 master and moments (18 B/parameter)"
    else:
        w, g, o, what = 4, 4, 8, "fp32 weights, gradients and AdamW moments (16 B/parameter)"
    ref = 2 if spec.grpo.kl_coef > 0 else 0
    what += ", a bf16 reference model (kl_coef > 0)" if ref else ""
    if spec.backend == "megatron":
        split = spec.tensor_parallel * spec.pipeline_parallel
        dp = max(1, world // split)
        how = f"megatron tp {spec.tensor_parallel} x pp {spec.pipeline_parallel} x dp {dp}, optimizer sharded over dp"
        return params * (w + ref) / split, params * g / split + params * o / (split * dp), f"{how}: {what}"
    if spec.backend == "fsdp2":
        gathered = 2 * shape.layer_params() * (2 if compute_bytes(topology, node) == 2 else w)
        how = f"fsdp2 over {world} rank(s), fully sharded, optimizer too, + 2 gathered layers"
        return params * (w + ref) / world + gathered, params * (g + o) / world, f"{how}: {what}"
    return params * (w + ref), params * (g + o), f"{spec.backend}, one device holds all: {what}"


def trainer_activations(
    topology: Topology, node: NodeSpec, shape: ModelShape, tokens: int, *, checkpointing: bool | None = None
) -> float:
    """Bytes of activations of one micro-batch of `tokens` tokens on one rank (module docstring);
    `checkpointing` tries another `activation_checkpointing` than the topology's."""
    spec, b = topology.run.trainer, compute_bytes(topology, node)
    checkpointing = spec.activation_checkpointing if checkpointing is None else checkpointing
    layer = tokens * (10 * shape.hidden + 4 * shape.active_intermediate) * b
    kept = shape.layers * tokens * shape.hidden * b + layer if checkpointing else shape.layers * layer
    if spec.backend != "megatron":
        chunk = min(spec.logprob_chunk_tokens or tokens, tokens)
        return kept + 2 * chunk * shape.vocab * 4
    row = min(longest_task(topology), tokens)
    scores = tokens * row * shape.heads * (4 + b if b < 4 else 4)  # (tokens / row) rows of row^2 per head
    kept += scores if checkpointing else shape.layers * scores
    return (kept + 2 * tokens * shape.vocab * 4) / spec.tensor_parallel


def compute_bytes(topology: Topology, node: NodeSpec) -> int:
    """Bytes per activation: bf16 with `precision: bf16`, or auto on a GPU; fp32 otherwise."""
    precision = topology.run.trainer.precision
    return 2 if precision == "bf16" or (precision == "auto" and node.resources.gpus > 0) else 4


def engine_dtype(topology: Topology, shape: ModelShape, *, on_gpu: bool) -> str:
    """The dtype a generator's engines run in: `run.generator.dtype`, auto being the checkpoint's; float16
    becomes float32 on CPU."""
    dtype = shape.dtype if topology.run.generator.dtype == "auto" else topology.run.generator.dtype
    return "float32" if dtype == "float16" and not on_gpu else dtype


def engine_activations(topology: Topology, shape: ModelShape, dtype: str, tp: int, *, on_gpu: bool) -> float:
    """Bytes an engine needs per GPU besides weights and KV cache (module docstring)."""
    batch = ENGINE_BATCH_TOKENS * (4 * shape.hidden + 3 * shape.active_intermediate / tp) * dtype_bytes(dtype)
    logits = topology.run.generator.max_num_seqs * shape.vocab * 4
    return (ENGINE_FIXED if on_gpu else 0) + batch + logits


def engine_need(topology: Topology, shape: ModelShape, dtype: str, tp: int, max_len: int) -> tuple[float, float, float]:
    """(weights, activations, KV of one `max_len`-token sequence), bytes per GPU of an engine over `tp` GPUs."""
    weights = shape.weight_bytes(dtype) / tp
    activations = engine_activations(topology, shape, dtype, tp, on_gpu=True)
    return weights, activations, shape.kv_bytes_per_token(dtype, tp) * max_len
