"""A decoder-only transformer's shape, read from a checkpoint's `config.json` without loading it, and
what that shape costs: parameters, weight bytes, KV-cache bytes per token.

    shape = read_shape("models/Qwen3-8B")   # or shape_from_config(json.load(...))
    shape.params()                          # 8_190_735_360
    shape.kv_bytes_per_token("bfloat16")    # 147_456: keys and values of every layer for one token

It reads the keys Qwen3, Qwen2/2.5 and Llama write (`hidden_size`, `intermediate_size`,
`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `vocab_size`,
`tie_word_embeddings`, `max_position_embeddings`, and the dtype as `torch_dtype` or, from
transformers 5, `dtype`). The parameter count is exact for these families: embeddings, per layer
the q/k/v/o projections (with q/k/v biases where the family has them: Qwen2), Qwen3's per-head
q/k norms, the SwiGLU MLP (gate, up, down) and two RMSNorms, then the final norm and the output
head unless it is tied to the embeddings. Imports no torch and nothing of `rollart`.

Mixture-of-experts decoders (Qwen2-MoE and Qwen3-MoE's keys: `num_experts`, `num_experts_per_tok`,
`moe_intermediate_size`, `shared_expert_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`): a sparse
layer's MLP is the router (hidden x experts), every expert's SwiGLU MLP and, in Qwen2-MoE, a shared expert with its
one-output gate; `params()` counts them all, `active_params()` the top-k experts a token goes through (what its
compute costs). Qwen3-30B-A3B: 30.53B parameters, 3.35B active.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rollart.models.checkpoint import config_dtype

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
"""Bytes per element of the dtypes a checkpoint or an engine names."""

_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}
"""Families whose q/k/v projections have biases (Qwen2 and Qwen2.5 write model_type qwen2)."""
_QK_NORM_TYPES = {"qwen3", "qwen3_moe"}
"""Families with an RMSNorm over each head's queries and keys."""


class ShapeError(ValueError):
    """A config.json that does not describe a decoder this module can size; the message says why."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What sizing needs to know about a decoder-only transformer."""

    name: str
    """Where the shape came from: a preset's name or the checkpoint folder."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    max_position_embeddings: int
    dtype: str = "bfloat16"
    """The checkpoint's own dtype (`torch_dtype` / `dtype` in config.json); float32 when it names none."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's queries and keys (head_dim weights each)."""
    qkv_bias: bool = False
    """Qwen2/2.5: biases on the q, k and v projections."""
    experts: int = 0
    """Mixture of experts: experts per sparse layer (0: a dense model)."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    """Each expert's MLP width (`moe_intermediate_size`)."""
    shared_expert_intermediate: int = 0
    """Qwen2-MoE's shared expert's width (0: none)."""
    sparse_layers: int = 0
    """How many of the layers have experts (the others a dense MLP of `intermediate`)."""

    def embedding_params(self) -> int:
        """The input embeddings (and the output head again when it is not tied to them)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def layer_params(self) -> int:
        """The largest decoder layer (a sparse one, in a mixture of experts): attention, MLP and the two norms."""
        return self._layer(sparse=self.sparse_layers > 0, experts=self.experts)

    def _layer(self, *, sparse: bool, experts: int) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        attention += (q + 2 * kv) if self.qkv_bias else 0
        attention += 2 * self.head_dim if self.qk_norm else 0
        if not sparse:
            return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        mlp = self.hidden * self.experts + experts * 3 * self.hidden * self.expert_intermediate  # router, experts
        if self.shared_expert_intermediate:
            mlp += 3 * self.hidden * self.shared_expert_intermediate + self.hidden  # the shared expert and its gate
        return attention + mlp + 2 * self.hidden

    def params(self) -> int:
        """Every parameter: embeddings, layers, the final norm, the output head unless tied."""
        return self._params(self.experts)

    def active_params(self) -> int:
        """The parameters one token goes through: `params()` with only the top-k of each sparse layer's experts."""
        return self._params(self.experts_per_token)

    def _params(self, experts: int) -> int:
        dense = (self.layers - self.sparse_layers) * self._layer(sparse=False, experts=0)
        sparse = self.sparse_layers * self._layer(sparse=True, experts=experts)
        return self.embedding_params() + dense + sparse + self.hidden

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token goes through in the widest layer: `intermediate` for a dense model, the top-k
        experts' (and the shared expert's) for a mixture of experts; what its activations scale with."""
        if not self.sparse_layers:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate

    def weight_bytes(self, dtype: str | None = None) -> int:
        """The weights in `dtype` (None: the checkpoint's own)."""
        return self.params() * dtype_bytes(dtype or self.dtype)

    def kv_bytes_per_token(self, dtype: str | None = None, tensor_parallel: int = 1) -> int:
        """Keys and values of every layer for one token, on one of `tensor_parallel` GPUs (each holds
        its share of the KV heads; a head is replicated when there are more GPUs than KV heads)."""
        heads_per_gpu = -(-self.kv_heads // tensor_parallel)
        return 2 * self.layers * heads_per_gpu * self.head_dim * dtype_bytes(dtype or self.dtype)

    def describe(self) -> str:
        """One line for `rollart check`: size, layers, width and dtype."""
        tied = ", tied embeddings" if self.tied_embeddings else ""
        moe = ""
        if self.sparse_layers:
            moe = f" ({_count(self.active_params())} active: {self.experts_per_token} of {self.experts} experts)"
        return (
            f"{self.name}: {_count(self.params())} parameters{moe}, {self.layers} layers, hidden {self.hidden}, "
            f"{self.heads} heads / {self.kv_heads} KV heads x {self.head_dim}, vocabulary {self.vocab}{tied}, "
            f"{self.max_position_embeddings} positions, {self.dtype}"
        )


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` (float32, bfloat16, float16, or torch's spelling `torch.bfloat16`)."""
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ShapeError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[name]


def shape_from_config(config: dict[str, Any], name: str = "config.json") -> ModelShape:
    """The shape a Hugging Face `config.json` (already parsed) describes; `name` names it in errors."""
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        config = {**config, **text}  # multimodal wrappers keep the decoder's keys in text_config
    missing = [
        key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if key not in config
    ]
    if missing:
        raise ShapeError(f"{name}: not a decoder config this can size: no {', '.join(missing)}")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        model_type = str(config.get("model_type", ""))
        dtype = config_dtype(config) or "float32"
        layers = int(config["num_hidden_layers"])
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        sparse = 0
        if experts:
            step, dense_only = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
            sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        shape = ModelShape(
            name=name,
            layers=layers,
            hidden=hidden,
            intermediate=int(config.get("intermediate_size") or 4 * hidden),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            dtype=dtype,
            qk_norm=model_type in _QK_NORM_TYPES,
            qkv_bias=model_type in _QKV_BIAS_TYPES or bool(config.get("attention_bias", False)),
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(config.get("moe_intermediate_size") or 0) if experts else 0,
            shared_expert_intermediate=int(config.get("shared_expert_intermediate_size") or 0) if experts else 0,
            sparse_layers=sparse,
        )
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{name}: {exc}") from exc
    dtype_bytes(shape.dtype)  # an unknown dtype fails here, naming it
    return shape


def read_shape(folder: str | Path) -> ModelShape:
    """The shape of the checkpoint in `folder`, from its config.json; ShapeError (or OSError) when it
    cannot be read or sized."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ShapeError(f"{path}: expected a JSON object")
    return shape_from_config(config, str(Path(folder)))


def _count(n: int) -> str:
    """8.19B, 29.3M, 0.62M: a parameter count at the scale it has."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
