"""Hugging Face causal-LM weights <-> Megatron-Core `GPTModel` shards, as pure tensor maps.

Supported: the Qwen3, Qwen2/Qwen2.5 and Llama families (dense, full attention, RoPE without
scaling); `architecture` reads one from a `config.json` dict (or a transformers config) and refuses
anything else naming what it cannot convert. `transformer_config_kwargs` and `gpt_model_kwargs` give
what Megatron-Core's `TransformerConfig` and `GPTModel` are built from; nothing here imports Megatron.

A Megatron shard is one (tensor-parallel rank, pipeline stage) of a `GPTModel` built with the local
layer spec (`get_gpt_layer_local_spec(qk_layernorm=...)`; Transformer Engine's spec names differ
only in its fused norms, see `TE_NAMES`, `Parallel.spec`). Per decoder layer (HF `model.layers.i.`):

- `self_attention.linear_qkv.weight` (and `.bias`, Qwen2) <- q_proj, k_proj, v_proj, interleaved per
  query group g: g's query heads, then its key head, then its value head. TP splits it into
  contiguous rows, which are whole query groups when groups % tp == 0 (and parts of one when
  tp % groups == 0, which Megatron 0.16 handles by gathering);
- `self_attention.linear_proj.weight` <- o_proj, row-parallel (split along dim 1);
- `self_attention.q_layernorm.weight`, `k_layernorm.weight` <- q_norm, k_norm (Qwen3), replicated;
- `mlp.linear_fc1.weight` <- [gate_proj; up_proj]; each TP shard is [gate shard; up shard];
- `mlp.linear_fc2.weight` <- down_proj, row-parallel;
- `input_layernorm.weight`, `pre_mlp_layernorm.weight` <- input_layernorm, post_attention_layernorm.

Outside the layers: `embedding.word_embeddings.weight` (first stage) and `output_layer.weight` (last
stage) are vocab-parallel (split along dim 0) over Megatron's padded vocabulary (`padded_vocab_size`:
a multiple of `divisible_by` x tp; zero rows are added on the way in and dropped on the way out);
`decoder.final_layernorm.weight` sits on the last stage. With tied embeddings there is no
`output_layer.weight` on one stage (GPTModel reads the embedding); with pipeline stages Megatron keeps
a copy of the embedding on the last stage as `output_layer.weight`, which it keeps equal by summing
the two copies' gradients (`finalize_model_grads`); on the way out the first stage's is read.

Stage s of pp holds layers [s L/pp, (s+1) L/pp), numbered from 0 in its state dict.

Going out, `to_hf` streams (HF name, full tensor) in the order of HF's own state dict, from a
`gather` function that returns each Megatron parameter's TP shards (None on processes that do not
assemble it), so the weight push can bucket tensors as they come; `megatron_to_hf` is that over
shards in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from rollart.errors import ConfigError

FAMILIES = ("qwen3", "qwen2", "llama")

TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Transformer Engine's layer spec fuses the pre-attention and pre-MLP norms into the next linear."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the conversion needs of a model's shape (`architecture`)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How the Megatron model is split."""

    tp: int = 1
    pp: int = 1
    divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x tp (Megatron-LM's make_vocab_size_divisible_by)."""
    spec: Literal["local", "te"] = "local"
    """Which GPTModel layer spec the names follow (module docstring)."""


def architecture(config: Mapping[str, Any] | Any) -> Architecture:
    """The architecture of an HF `config.json` (a dict, or a transformers config); raises ConfigError
    naming what is not supported (MoE, sliding windows, scaled RoPE, biases, other families)."""
    c = dict(config if isinstance(config, Mapping) else config.to_dict())
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(
            f"model_type {kind!r} cannot be converted to Megatron-Core (supported: {', '.join(FAMILIES)})"
        )
    unsupported = []
    if c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts"):
        unsupported.append("mixture of experts")
    if c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or []):
        unsupported.append("sliding-window attention")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r}")
    if c.get("mlp_bias"):
        unsupported.append("mlp_bias")
    if kind != "qwen2" and c.get("attention_bias"):
        unsupported.append("attention_bias (an o_proj bias)")
    if c.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {c['hidden_act']!r}")
    if unsupported:
        raise ConfigError(f"{kind} model: {', '.join(unsupported)} cannot be converted to Megatron-Core")
    heads = int(c["num_attention_heads"])
    return Architecture(
        model_type=kind,
        num_layers=int(c["num_hidden_layers"]),
        hidden_size=int(c["hidden_size"]),
        ffn_hidden_size=int(c["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        vocab_size=int(c["vocab_size"]),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2",  # Qwen2 always has q/k/v biases (and no o_proj bias)
        qk_norm=kind == "qwen3",
    )


def check_parallel(arch: Architecture, parallel: Parallel) -> list[tuple[str, str]]:
    """(run.trainer field, problem) for each way `parallel` does not divide the model."""
    tp, pp, problems = parallel.tp, parallel.pp, []
    groups = arch.num_query_groups
    if arch.num_attention_heads % tp or (groups % tp and tp % groups):
        problems.append(
            (
                "tensor_parallel",
                f"{tp} must divide the {arch.num_attention_heads} attention heads, and divide or be a "
                f"multiple of the {groups} key/value heads",
            )
        )
    if arch.ffn_hidden_size % tp:
        problems.append(("tensor_parallel", f"{tp} does not divide the MLP width {arch.ffn_hidden_size}"))
    if arch.num_layers % pp:
        problems.append(("pipeline_parallel", f"{pp} does not divide the {arch.num_layers} layers"))
    return problems


def transformer_config_kwargs(arch: Architecture) -> dict[str, Any]:
    """Megatron-Core `TransformerConfig` arguments for the model (add the parallel sizes, dtypes and
    initialisation flags). Dropout is off: training log-probs must be the generators' log-probs."""
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }


def gpt_model_kwargs(arch: Architecture, parallel: Parallel) -> dict[str, Any]:
    """Megatron-Core `GPTModel` arguments besides its config and layer spec."""
    return {
        "vocab_size": padded_vocab_size(arch.vocab_size, parallel),
        "max_sequence_length": arch.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": arch.rope_theta,
        "share_embeddings_and_output_weights": arch.tied_embeddings,
    }


def padded_vocab_size(vocab: int, parallel: Parallel) -> int:
    multiple = parallel.divisible_by * parallel.tp
    return -(-vocab // multiple) * multiple


def stage_layers(arch: Architecture, parallel: Parallel, stage: int) -> range:
    per = arch.num_layers // parallel.pp
    return range(stage * per, (stage + 1) * per)


# -- one Megatron parameter and its HF sources ------------------------------------------------------

Kind = Literal["qkv", "fc1", "vocab", "row", "replicated"]


@dataclasses.dataclass(frozen=True)
class Param:
    """One Megatron parameter: `name` with the layer numbered globally, made of the `hf` tensors."""

    name: str
    hf: tuple[str, ...]
    kind: Kind
    layer: int | None = None

    def fuse(self, hf: Mapping[str, torch.Tensor], arch: Architecture, parallel: Parallel) -> torch.Tensor:
        """The whole Megatron tensor from the HF ones."""
        parts = [hf[name] for name in self.hf]
        if self.kind == "qkv":
            return _interleave_qkv(*parts, arch=arch)
        if self.kind == "fc1":
            return torch.cat(parts)
        if self.kind == "vocab":
            (table,) = parts
            pad = padded_vocab_size(arch.vocab_size, parallel) - table.shape[0]
            return torch.cat([table, table.new_zeros(pad, *table.shape[1:])]) if pad else table
        return parts[0]

    def split(self, whole: torch.Tensor, tp: int) -> list[torch.Tensor]:
        """Its TP shards, rank by rank."""
        if self.kind == "replicated":
            return [whole] * tp
        if self.kind == "row":
            return list(whole.chunk(tp, dim=1))
        if self.kind == "fc1":
            gate, up = whole.chunk(2)
            return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
        return list(whole.chunk(tp))  # qkv (interleaved: whole groups per rank) and vocab rows

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from its TP shards (`split`'s inverse)."""
        if self.kind == "replicated":
            return shards[0]
        if self.kind == "row":
            return torch.cat(shards, dim=1)
        if self.kind == "fc1":
            halves = [shard.chunk(2) for shard in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards)

    def unfuse(self, whole: torch.Tensor, arch: Architecture) -> dict[str, torch.Tensor]:
        """The HF tensors (`fuse`'s inverse)."""
        if self.kind == "qkv":
            return dict(zip(self.hf, _split_qkv(whole, arch), strict=True))
        if self.kind == "fc1":
            return dict(zip(self.hf, (part.contiguous() for part in whole.chunk(2)), strict=True))
        if self.kind == "vocab":
            return {self.hf[0]: whole[: arch.vocab_size]}
        return {self.hf[0]: whole}

    def local_name(self, arch: Architecture, parallel: Parallel) -> str:
        """Its name in its stage's state dict (layer numbered within the stage, spec's names)."""
        if self.layer is None:
            return self.name
        stage_first = self.layer - self.layer % (arch.num_layers // parallel.pp)
        suffix = self.name.removeprefix(f"decoder.layers.{self.layer}.")
        if parallel.spec == "te":
            suffix = TE_NAMES.get(suffix, suffix)
        return f"decoder.layers.{self.layer - stage_first}.{suffix}"

    def stages(self, arch: Architecture, parallel: Parallel) -> list[int]:
        """The pipeline stages that hold it."""
        last = parallel.pp - 1
        if self.layer is not None:
            return [self.layer // (arch.num_layers // parallel.pp)]
        if self.name.startswith("embedding."):
            return [0]
        return [last]


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, arch: Architecture) -> torch.Tensor:
    groups, head = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // groups
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per * head, *rest), k.reshape(groups, head, *rest), v.reshape(groups, head, *rest)], dim=1
    )
    return fused.reshape(groups * (per + 2) * head, *rest)


def _split_qkv(whole: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, ...]:
    groups, head = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // groups
    rest = whole.shape[1:]
    q, k, v = torch.split(whole.reshape(groups, (per + 2) * head, *rest), [per * head, head, head], dim=1)
    return tuple(part.reshape(-1, *rest).contiguous() for part in (q, k, v))


def layer_params(arch: Architecture, i: int) -> list[Param]:
    """Layer i's parameters, in HF's order of their first source."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = f"{h}self_attn."
    qkv = tuple(f"{attn}{p}_proj.weight" for p in "qkv")
    params = [Param(f"{m}self_attention.linear_qkv.weight", qkv, "qkv", i)]
    if arch.qkv_bias:
        params.append(
            Param(f"{m}self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv", i)
        )
    params.append(Param(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "row", i))
    if arch.qk_norm:
        params += [
            Param(f"{m}self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), "replicated", i),
            Param(f"{m}self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), "replicated", i),
        ]
    return [
        *params,
        Param(f"{m}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "fc1", i),
        Param(f"{m}mlp.linear_fc2.weight", (f"{h}mlp.down_proj.weight",), "row", i),
        Param(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), "replicated", i),
        Param(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",), "replicated", i),
    ]


EMBEDDING = Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
FINAL_NORM = Param("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
OUTPUT = Param("output_layer.weight", ("lm_head.weight",), "vocab")


def param_groups(arch: Architecture) -> list[list[Param]]:
    """Every Megatron parameter, grouped as HF orders its state dict: embeddings, each layer, the
    final norm and output head (tied: none; `to_hf` gives `lm_head.weight` from the embeddings)."""
    tail = [FINAL_NORM] if arch.tied_embeddings else [FINAL_NORM, OUTPUT]
    return [[EMBEDDING], *(layer_params(arch, i) for i in range(arch.num_layers)), tail]


def hf_names(arch: Architecture, params: list[Param]) -> list[str]:
    """The HF names `params` come from, in HF's state-dict order (within a layer: attention's
    projections with their biases, q/k norms, the MLP, then the two norms)."""
    names = [name for param in params for name in param.hf]
    return sorted(names, key=lambda name: (_hf_rank(name), names.index(name)))


def _hf_rank(name: str) -> int:
    for rank, piece in enumerate(("q_proj.", "k_proj.", "v_proj.", "o_proj.")):
        if piece in name:
            return rank
    return 4


# -- whole conversions ----------------------------------------------------------------------------


def to_megatron(
    hf: Mapping[str, torch.Tensor], arch: Architecture, parallel: Parallel, *, tp_rank: int, stage: int
) -> dict[str, torch.Tensor]:
    """The state dict of one (TP rank, pipeline stage) of the Megatron model, from HF's (which may be
    a lazy mapping: only this stage's tensors are read)."""
    out = {}
    for group in param_groups(arch):
        for param in group:
            if stage in param.stages(arch, parallel):
                whole = param.fuse(hf, arch, parallel)
                out[param.local_name(arch, parallel)] = param.split(whole, parallel.tp)[tp_rank]
    if arch.tied_embeddings and parallel.pp > 1 and stage == parallel.pp - 1:
        # Megatron's copy of the tied embedding on the last stage (module docstring)
        out[OUTPUT.name] = EMBEDDING.split(EMBEDDING.fuse(hf, arch, parallel), parallel.tp)[tp_rank]
    return out


Gather = Callable[[Param], "list[torch.Tensor] | None"]
"""A Megatron parameter -> its TP shards in rank order (None where this process does not assemble it)."""


def to_hf(arch: Architecture, gather: Gather) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) in HF's state-dict order, from `gather`'s shards, one layer at a time;
    a tied model's `lm_head.weight` is its embedding. Every process must run it through (gather may
    be a collective); it yields only where `gather` returns shards."""
    embedding: torch.Tensor | None = None
    for group in param_groups(arch):
        out: dict[str, torch.Tensor] = {}
        for param in group:
            shards = gather(param)
            if shards is not None:
                out |= param.unfuse(param.merge(shards), arch)
        embedding = out.get(EMBEDDING.hf[0], embedding)
        for name in hf_names(arch, group):
            if name in out:
                yield name, out[name]
    if arch.tied_embeddings and embedding is not None:
        yield OUTPUT.hf[0], embedding


def megatron_to_hf(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], arch: Architecture, parallel: Parallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_hf` over shards in memory, keyed by (TP rank, pipeline stage)."""

    def gather(param: Param) -> list[torch.Tensor]:
        stage = param.stages(arch, parallel)[0]
        name = param.local_name(arch, parallel)
        return [shards[rank, stage][name] for rank in range(parallel.tp)]

    return to_hf(arch, gather)
