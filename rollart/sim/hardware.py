"""Hardware and model presets, and the cost model the simulated engine, trainer and links use.

An LLM step is bound by one of two things (the roofline): arithmetic, for prefill and training
(about 2 FLOPs per parameter per token forward, 6 with the backward pass), or memory bandwidth,
for decode (every step reads all the weights once, plus each running request's KV cache). So:

    prefill_s(n)        = 2 * active_params * n / (gpus * tflops * mfu)
    decode_step_s(B, C) = max(2 * active_params * B / (gpus * tflops * mfu),
                              (weight_bytes + kv_bytes_per_token * C) / (gpus * hbm_bw * mbu))

for B requests in the batch holding C context tokens in all. A training step on T tokens takes
6 * active_params * T / (GPUs * TFLOPS * mfu) (forward and backward), and pushing the weights over a
link of L Gb/s takes weight_bytes * 8 / (L * 1e9). A batch of decodes costs barely more
than one until the weight read stops dominating: that is why decode wants many requests at once,
and why a card with more bandwidth per dollar (H20) decodes more cheaply than one with more FLOPs
(H800) while its batch is small: past a few dozen requests an H20 engine runs out of arithmetic
(a dense 32B model decodes at most about 9,000 tokens/s on 8 H20 at mfu 0.5). A mixture of experts
runs each token through its active parameters only (`active_params`, all of them for a dense model)
but reads every expert's weights in a decode step (any batch of more than a few tokens touches them
all): it stays bandwidth-bound to far larger batches. KV-cache capacity is what is left of HBM after
the weights, times `mem_fraction`.

Presets: the paper's H800 (989.5 TFLOPS bf16 dense, 3.35 TB/s, 80 GB, cost 2.85 per GPU-hour
relative to H20) and H20 (148 TFLOPS, 4.0 TB/s, 96 GB, cost 1.00); H100 and H200 from their
data sheets, costed relative to H20 by the same rule of thumb (our assumption, not the paper's).
Models: Qwen3 8B, 14B and 32B, and the mixture of experts Qwen3-30B-A3B, from their published
configs. `mfu` and `mbu` (the fractions of peak FLOPs and bandwidth an engine reaches) are
assumptions, stated where they are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec

from rollart.errors import ConfigError


class _Preset(Protocol):
    @property
    def name(self) -> str: ...


_P = TypeVar("_P", bound=_Preset)


def _by_name(*presets: _P) -> dict[str, _P]:
    """A preset table: the presets by their names."""
    return {preset.name: preset for preset in presets}


@dataclass(frozen=True)
class Gpu:
    """One accelerator: peak dense bf16 TFLOPS, HBM bandwidth (TB/s), HBM size (GB), cost."""

    name: str
    tflops: float
    hbm_tb_s: float
    hbm_gb: float
    cost_per_hour: float
    """Relative to an H20 (1.00), as the paper costs them."""


GPUS: dict[str, Gpu] = _by_name(
    Gpu("H800", tflops=989.5, hbm_tb_s=3.35, hbm_gb=80, cost_per_hour=2.85),
    Gpu("H20", tflops=148.0, hbm_tb_s=4.0, hbm_gb=96, cost_per_hour=1.00),
    Gpu("H100", tflops=989.5, hbm_tb_s=3.35, hbm_gb=80, cost_per_hour=2.85),
    Gpu("H200", tflops=989.5, hbm_tb_s=4.8, hbm_gb=141, cost_per_hour=3.40),
)


@dataclass(frozen=True)
class Model:
    """A transformer's size: parameters (all, and those one token runs through) and what one token of KV cache
    holds."""

    name: str
    params_b: float
    """Parameters, billions: the weights held and read."""
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    """bf16 weights and KV cache."""
    active_params_b: float | None = None
    """A mixture of experts' parameters one token runs through, billions (its FLOPs); None: a dense model's, all."""

    @property
    def flops_params(self) -> float:
        """Parameters whose arithmetic one token costs (2 FLOPs each forward, 6 with the backward pass)."""
        return (self.params_b if self.active_params_b is None else self.active_params_b) * 1e9

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


MODELS: dict[str, Model] = _by_name(
    Model("qwen3-8b", params_b=8.19, layers=36, kv_heads=8, head_dim=128),
    Model("qwen3-14b", params_b=14.8, layers=40, kv_heads=8, head_dim=128),
    Model("qwen3-32b", params_b=32.8, layers=64, kv_heads=8, head_dim=128),
    Model("qwen3-30b-a3b", params_b=30.5, layers=48, kv_heads=4, head_dim=128, active_params_b=3.3),
    Model("qwen2.5-7b", params_b=7.62, layers=28, kv_heads=4, head_dim=128),  # the paper's reward LLM
)


class EngineShape(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One simulated inference engine: which GPUs, how many (tensor parallel), and how well it uses them."""

    gpu: str = "H800"
    """A key of `GPUS`: H800, H20, H100, H200."""
    gpus: int = 1
    """GPUs one replica spans (tensor parallel)."""
    replicas: int = 1
    """Copies of the engine behind one generator node (data parallel): replicas x gpus GPUs in all."""
    mfu: float = 0.5
    """Fraction of peak FLOPs reached in prefill (assumption)."""
    mbu: float = 0.7
    """Fraction of peak HBM bandwidth reached in decode (assumption)."""
    mem_fraction: float = 0.9
    """Fraction of HBM the engine may use, weights included (vLLM's gpu_memory_utilization)."""


def train_step_s(model: Model, gpu: Gpu, *, gpus: int, mfu: float, tokens: int) -> float:
    """Seconds for one training step (forward and backward) on `tokens` tokens."""
    return 6 * model.flops_params * tokens / (gpus * gpu.tflops * 1e12 * mfu)


def transfer_s(model: Model, *, gbps: float) -> float:
    """Seconds to move the model's weights over a link of `gbps` gigabits per second."""
    return model.weight_bytes * 8 / (gbps * 1e9)


@dataclass(frozen=True)
class CostModel:
    """Timings of one engine shape running one model."""

    gpu: Gpu
    model: Model
    shape: EngineShape

    @classmethod
    def build(cls, shape: EngineShape, model: str) -> CostModel:
        if shape.gpu not in GPUS:
            raise ConfigError(f"unknown GPU {shape.gpu!r}; expected one of {sorted(GPUS)}")
        if model not in MODELS:
            raise ConfigError(f"unknown model {model!r}; expected one of {sorted(MODELS)}")
        cost = cls(GPUS[shape.gpu], MODELS[model], shape)
        if cost.kv_capacity_tokens <= 0:
            raise ConfigError(
                f"{model} ({cost.model.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
                f"{shape.gpus} x {shape.gpu} at mem_fraction {shape.mem_fraction}; give the engine more GPUs"
            )
        return cost

    @property
    def flops_per_s(self) -> float:
        return self.shape.gpus * self.gpu.tflops * 1e12 * self.shape.mfu

    @property
    def bytes_per_s(self) -> float:
        return self.shape.gpus * self.gpu.hbm_tb_s * 1e12 * self.shape.mbu

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights."""
        free = self.shape.gpus * self.gpu.hbm_gb * 1e9 * self.shape.mem_fraction - self.model.weight_bytes
        return int(free // self.model.kv_bytes_per_token)

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens` prompt tokens (compute-bound)."""
        return 2 * self.model.flops_params * tokens / self.flops_per_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of `batch` requests holding `context_tokens` in all."""
        compute = 2 * self.model.flops_params * batch / self.flops_per_s
        memory = (self.model.weight_bytes + self.model.kv_bytes_per_token * context_tokens) / self.bytes_per_s
        return max(compute, memory)

    @property
    def cost_per_hour(self) -> float:
        """Of every replica."""
        return self.shape.gpus * self.shape.replicas * self.gpu.cost_per_hour
