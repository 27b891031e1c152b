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

from collections.abc import Mapping
from typing import Literal

import msgspec

from rollart.rewards.release import Release
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
    """Bandwidth of the trainer's egress to the generators, which sit in another cluster: the
    paper's 200 Gb/s Ethernet across clusters (400 for InfiniBand inside one). A star shares it
    among a copy per engine replica; a relay sends one copy over it."""
    push: Literal["async", "sync"] = "async"
    """sync: after each step the trainer sends the weights to every engine and waits, and the engines
    stop generating while they receive (an NCCL broadcast, veRL's way); async: the trainer hands them
    off and goes on, each engine receives them in the background and stops only to load them from
    host memory (the paper's Mooncake store). The sync schedule always pushes synchronously."""
    host_load_gbs: float = 25.0
    """Async push: GB/s per GPU from host memory to the GPU (PCIe), what an engine stops for."""
    plan: Literal["star", "relay"] = "star"
    """How the weights reach the engine replicas (`rollart/sim/weight_sync.py`): star, the trainer
    sends each its own copy at once; relay, the trainer sends each bucket once and the replicas
    forward it as it arrives, along a chain or tree planned by cluster and host."""
    relay_fanout: int = 1
    """Relay: how many replicas each one forwards to (1: a chain)."""
    bucket_mb: int = 64
    """MiB per bucket, as the real trainer's `run.trainer.bucket_mb`."""
    cluster_gbps: float = 400.0
    """Relay: between generator hosts inside their cluster (the paper's 400 Gb/s InfiniBand)."""
    host_gbps: float = 3200.0
    """Relay: between replicas on one host (an H800's 400 GB/s NVLink, NVIDIA's data sheet)."""


class SimRewardSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A reward model's scoring time and where it runs (`rollart/sim/reward.py`): the judge, then where its
    workers run."""

    model: str = "qwen2.5-7b"
    """The reward model, a key of the model presets."""
    gpu: str = "H800"
    """A key of `GPUS`."""
    gpus_per_worker: int = 1
    """GPUs one worker's model spans (tensor parallel)."""
    verdict_tokens: int = 16
    """Tokens the judge writes per trajectory."""
    placement: Literal["local", "service", "instant"] = "service"
    """local: `workers` GPUs reserved for the whole run; service: workers started on demand;
    instant: no reward model, the function's verdict at once (a rule-based reward)."""
    workers: int = 4
    """local: the reserved workers; service: the most it scales to."""
    min_workers: int = 0
    """service: workers kept even when idle."""
    cold_start_s: float = 15.0
    """service: from asking for a worker to it serving (the function's start and model load)."""
    warm_start_s: float | None = None
    """service: a start once the service holds the judge's weights in its hosts' memory, which it does from
    its first cold start on (the weights onto a GPU at PCIe speed, and the process); None: every start is
    cold. Scaling up still waits for a queue longer than `cold_start_s`; releasing weighs the warm start."""
    idle_timeout_s: float = 30.0
    """service: an idle worker is released after this long (`release: idle`), or at most this long (`by-gap`)."""
    release: Release = "idle"
    """service: idle releases a worker idle for `idle_timeout_s` (the paper's); by-gap releases it as soon as
    the wait for its next request, predicted from the gaps between arrivals, outlasts a cold start (keeping it
    would then cost more than starting one again), or the recent load would keep the other workers at most
    0.9 busy, and looks again every cold start while it idles."""
    scale_up: Literal["by-wait", "per-request"] = "by-wait"
    """service: by-wait starts a worker when the queue's work would keep its last request waiting longer
    than a cold start (a new worker serves it sooner), so the live workers follow the load; per-request
    starts one per waiting request (up to `workers`): the shortest waits, and most workers idle after a burst."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs, the fields under `reward.`."""
        problems = _unknown("reward.model", self.model, MODELS) + _unknown("reward.gpu", self.gpu, GPUS)
        for key in ("gpus_per_worker", "workers", "verdict_tokens"):
            problems += _at_least(f"reward.{key}", getattr(self, key), 1)
        if not 0 <= self.min_workers <= self.workers:
            problems.append(("reward.min_workers", f"expected 0 <= min_workers <= workers; got {self.min_workers}"))
        if self.cold_start_s < 0 or self.idle_timeout_s <= 0:
            problems.append(("reward", "expected cold_start_s >= 0 and idle_timeout_s > 0"))
        warm = self.warm_start_s
        if warm is not None and not 0 <= warm <= self.cold_start_s:
            problems.append(("reward.warm_start_s", f"expected 0 <= warm_start_s <= cold_start_s; got {warm}"))
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
    prefix_cache: bool = False
    """Model vLLM's automatic prefix caching: each engine replica keeps the KV cache of the prompts and replies it
    ran, by blocks of `PREFIX_BLOCK` tokens, least recently used out first, within its KV-cache size; a prompt
    whose leading blocks a replica holds prefills only the rest, and a replica with room first takes the
    waiting requests whose prefix it holds (as a prefix-aware router in front of separate engines would). Off
    by default: the paper-figure results so far were measured without it."""
    kv_link_gbps: float = 200.0
    """`rollout.routing: disaggregated`: each engine replica's link (Gb/s) for KV cache handed to it by the
    engine that prefilled the prompt (default: the paper's 200 Gb/s Ethernet between its two clusters)."""
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
        problems += _unknown("model", self.model, MODELS)
        for kind, shape in self.engines.items():
            problems += _unknown(f"engines.{kind}.gpu", shape.gpu, GPUS)
            for key in ("gpus", "replicas"):
                problems += _at_least(f"engines.{kind}.{key}", getattr(shape, key), 1)
        if self.kv_link_gbps <= 0:
            problems.append(("kv_link_gbps", f"expected a value > 0; got {self.kv_link_gbps}"))
        if not 0 < self.response_length_min_frac <= 1:
            problems.append(
                ("response_length_min_frac", f"expected a value in (0, 1]; got {self.response_length_min_frac}")
            )
        if self.trainer is not None:
            problems += _unknown("trainer.gpu", self.trainer.gpu, GPUS)
            for key in ("gpus", "mfu", "link_gbps", "host_load_gbs", "cluster_gbps", "host_gbps"):
                if getattr(self.trainer, key) <= 0:
                    problems.append((f"trainer.{key}", f"expected a value > 0; got {getattr(self.trainer, key)}"))
            for key in ("relay_fanout", "bucket_mb"):
                problems += _at_least(f"trainer.{key}", getattr(self.trainer, key), 1)
        if self.reward is not None:
            problems += self.reward.validate()
        problems += _at_least("max_steps_per_wake", self.max_steps_per_wake, 1)
        return problems


def _unknown(path: str, name: str, presets: Mapping[str, object]) -> list[tuple[str, str]]:
    """The problem with a preset name that is not one of `presets`, if it is not."""
    return [] if name in presets else [(path, f"expected one of {sorted(presets)}; got {name!r}")]


def _at_least(path: str, value: int, low: int) -> list[tuple[str, str]]:
    """The problem with an integer below `low`, if it is."""
    return [] if value >= low else [(path, f"expected an integer >= {low}; got {value}")]
