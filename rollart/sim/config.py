"""`run.sim`: what simulation mode simulates (the model, each hardware kind's engine) and how fast.

    run:
      generator: {backend: sim}
      sim:
        speedup: 10
        model: qwen3-32b
        engines:
          compute: {gpu: H800, gpus: 8}
          bandwidth: {gpu: H20, gpus: 8}

A generator node with `backend: sim` runs a `SimEngine` shaped by `engines[<its hardware>]`;
env-hosts wait simulated env latency (`sim` envs) on a clock `speedup` times faster than real time;
with `trainer`, a rollout-only trainer spends a modelled training step and weight push per batch.
Deadlines in `run.rollout` (generate, env, reward, group) stay in real seconds.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rollart.sim.hardware import GPUS, MODELS, EngineShape


def _default_engines() -> dict[str, EngineShape]:
    return {
        "compute": EngineShape(gpu="H800", gpus=8),
        "bandwidth": EngineShape(gpu="H20", gpus=8),
        "cpu": EngineShape(gpu="H20", gpus=8),
    }


class SimTrainerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A simulated trainer: in rollout-only mode each batch costs a modelled training step and push."""

    gpu: str = "H800"
    """A key of `GPUS`."""
    gpus: int = 32
    """Training GPUs."""
    mfu: float = 0.4
    """Fraction of peak FLOPs training reaches (assumption)."""
    link_gbps: float = 200.0
    """Bandwidth of the weight push to the generators: 400 for InfiniBand inside a cluster, 200 for
    the paper's Ethernet across clusters. Every engine replica gets its own copy over it."""
    push: Literal["async", "sync"] = "async"
    """sync: after each step the trainer sends the weights to every engine and waits, and the engines
    stop generating while they receive (an NCCL broadcast, veRL's way); async: the trainer hands them
    off and goes on, each engine receives them in the background and stops only to load them from
    host memory (the paper's Mooncake store). The sync schedule always pushes synchronously."""
    host_load_gbs: float = 25.0
    """Async push: GB/s per GPU from host memory to the GPU (PCIe), what an engine stops for."""


class SimRewardSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A reward model's scoring time and where it runs (`rollart/sim/reward.py`)."""

    placement: Literal["local", "service", "instant"] = "service"
    """local: `workers` GPUs reserved for the whole run; service: workers started on demand;
    instant: no reward model, the function's verdict at once (a rule-based reward)."""
    model: str = "qwen2.5-7b"
    """The reward model, a key of the model presets."""
    gpu: str = "H800"
    gpus_per_worker: int = 1
    workers: int = 4
    """local: the reserved workers; service: the most it scales to."""
    min_workers: int = 0
    """service: workers kept even when idle."""
    cold_start_s: float = 15.0
    """service: from asking for a worker to it serving (the function's start and model load)."""
    idle_timeout_s: float = 30.0
    """service: an idle worker is released after this long."""
    verdict_tokens: int = 16
    """Tokens the judge writes per trajectory."""

    def validate(self) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        if self.model not in MODELS:
            problems.append(("reward.model", f"expected one of {sorted(MODELS)}; got {self.model!r}"))
        if self.gpu not in GPUS:
            problems.append(("reward.gpu", f"expected one of {sorted(GPUS)}; got {self.gpu!r}"))
        for key in ("gpus_per_worker", "workers", "verdict_tokens"):
            if getattr(self, key) < 1:
                problems.append((f"reward.{key}", f"expected an integer >= 1; got {getattr(self, key)}"))
        if not 0 <= self.min_workers <= self.workers:
            problems.append(("reward.min_workers", f"expected 0 <= min_workers <= workers; got {self.min_workers}"))
        if self.cold_start_s < 0 or self.idle_timeout_s <= 0:
            problems.append(("reward", "expected cold_start_s >= 0 and idle_timeout_s > 0"))
        return problems


class SimSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Simulation mode's model, engine shapes and clock."""

    speedup: float = 1.0
    """Simulated seconds per real second."""
    model: str = "qwen3-32b"
    """A model preset: qwen3-8b, qwen3-14b, qwen3-32b."""
    engines: dict[str, EngineShape] = msgspec.field(default_factory=_default_engines)
    """The engine each generator runs, by the node's `hardware` (compute, bandwidth, cpu)."""
    response_length_min_frac: float = 1.0
    """Responses are `max_tokens` long, or with this < 1 drawn between this fraction of it and all of it."""
    max_steps_per_wake: int = 8
    """Decode steps a simulated engine runs between looks at its queue."""
    trainer: SimTrainerSpec | None = None
    """In rollout-only mode, make each batch cost a simulated training step and weight push (the
    sync schedule waits for both; async only for the step). None: batches cost nothing."""
    reward: SimRewardSpec | None = None
    """The reward gateway scores with a simulated reward model (local GPUs or a service) instead of
    its worker processes. None: the real pool, in real time."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable."""
        problems: list[tuple[str, str]] = []
        if self.speedup <= 0:
            problems.append(("speedup", f"expected a value > 0; got {self.speedup}"))
        if self.model not in MODELS:
            problems.append(("model", f"expected one of {sorted(MODELS)}; got {self.model!r}"))
        for kind, shape in self.engines.items():
            if shape.gpu not in GPUS:
                problems.append((f"engines.{kind}.gpu", f"expected one of {sorted(GPUS)}; got {shape.gpu!r}"))
            for key in ("gpus", "replicas"):
                if getattr(shape, key) < 1:
                    problems.append((f"engines.{kind}.{key}", f"expected an integer >= 1; got {getattr(shape, key)}"))
        if not 0 < self.response_length_min_frac <= 1:
            problems.append(
                ("response_length_min_frac", f"expected a value in (0, 1]; got {self.response_length_min_frac}")
            )
        if self.trainer is not None:
            if self.trainer.gpu not in GPUS:
                problems.append(("trainer.gpu", f"expected one of {sorted(GPUS)}; got {self.trainer.gpu!r}"))
            for key in ("gpus", "mfu", "link_gbps", "host_load_gbs"):
                if getattr(self.trainer, key) <= 0:
                    problems.append((f"trainer.{key}", f"expected a value > 0; got {getattr(self.trainer, key)}"))
        if self.reward is not None:
            problems += self.reward.validate()
        if self.max_steps_per_wake < 1:
            problems.append(("max_steps_per_wake", f"expected an integer >= 1; got {self.max_steps_per_wake}"))
        return problems
