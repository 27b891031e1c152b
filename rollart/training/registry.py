"""The training backends by name (`run.trainer.backend`): what each can do, how a spec is checked against it,
and how its engine is built.

A backend is one record in `TRAINING_BACKENDS`: adding one is its folder under `rollart/training/` and its line
here. A record's builder imports its backend (and torch) only when chosen, so the topology, the launcher and the
CLI ask a record what a backend can do without loading one; mypy checks that what a builder returns is a
`TrainingEngine`. Imports run one way: this registry -> a backend -> the spec, the engine protocol and the
shared machinery (`step`, `logprobs`, `ranks/`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollart.errors import ConfigError
from rollart.training.spec import RankLayout, TrainerSpec

if TYPE_CHECKING:
    from rollart.training.engine import TrainingEngine
    from rollart.training.ranks.process import RankMain

Builder = Callable[[TrainerSpec, str | Path, int, RankLayout], "TrainingEngine"]


@dataclass(frozen=True)
class TrainingBackend:
    """What a training backend can do, and how to build its engine."""

    build: Builder
    """spec, model path, seed, rank layout -> the engine; blocks while it loads (call it in a worker thread)."""
    rank_main: Callable[[], RankMain] | None = None
    """The entry point of its rank processes (`rollart.training.ranks.group.RankGroup` starts them), imported
    when called; None: it trains in the node's own process, on one device."""
    node_groups: bool = False
    """Its ranks may span a group of trainer nodes (`primary:` in the topology)."""
    splits_layers: bool = False
    """It splits each layer's matrices (`tensor_parallel`) and the layers (`pipeline_parallel`) over ranks."""
    lora: bool = False
    """It trains LoRA adapters (`run.trainer.lora`)."""


def build_training_engine(
    spec: TrainerSpec, model_path: str | Path, *, seed: int, layout: RankLayout | None = None
) -> TrainingEngine:
    """The training engine `spec.backend` names, on the model at `model_path`, with its ranks placed
    by `layout` (None: `spec.ranks` ranks on this node alone); blocks while it loads (call it in a
    worker thread). Raises ConfigError naming `run.trainer.backend` for an unknown one."""
    return backend(spec.backend).build(
        spec, model_path, seed, layout or RankLayout(world_size=spec.ranks, local_ranks=spec.ranks)
    )


def backend(name: str) -> TrainingBackend:
    """The record of `run.trainer.backend: name`; ConfigError with the known names for an unknown one."""
    if (record := TRAINING_BACKENDS.get(name)) is None:
        raise ConfigError(f"run.trainer.backend: {unknown_backend(name)}")
    return record


def unknown_backend(name: str) -> str:
    hint = difflib.get_close_matches(name, TRAINING_BACKENDS, n=1)
    known = ", ".join(sorted(TRAINING_BACKENDS))
    return f"unknown training backend {name!r} (known: {known})" + (f"; did you mean {hint[0]!r}?" if hint else "")


def check(spec: TrainerSpec) -> list[tuple[str, str]]:
    """(field of `run.trainer`, problem) for what `spec` asks of its backend that the backend cannot do."""
    record = TRAINING_BACKENDS.get(spec.backend)
    if record is None:
        return [("backend", unknown_backend(spec.backend))]
    problems = []
    if spec.lora is not None and not record.lora:
        problems.append(("lora", f"LoRA trains on the {_which(lora=True)} backends; backend is {spec.backend}"))
    for key in ("tensor_parallel", "pipeline_parallel"):
        if getattr(spec, key) > 1 and not record.splits_layers:
            problems.append(
                (key, f"only the {_which(splits_layers=True)} backend splits layers; backend is {spec.backend}")
            )
    if record.splits_layers and spec.tensor_parallel >= 1 and spec.ranks % spec.tensor_parallel:
        # a tensor-parallel group stays on one node (its all-reduces run in every layer)
        problems.append(
            ("tensor_parallel", f"{spec.tensor_parallel} must divide run.trainer.ranks ({spec.ranks}, per node)")
        )
    if spec.ranks > 1 and record.rank_main is None:
        use = _which(node_groups=True)
        problems.append(
            ("ranks", f"the {spec.backend} backend trains on one device; use backend {use} for {spec.ranks}")
        )
    return problems


def _which(**can: bool) -> str:
    """The names of the backends whose records have the given values, joined with "and"."""
    names = [name for name, record in TRAINING_BACKENDS.items() if all(getattr(record, k) == v for k, v in can.items())]
    return " and ".join(names)


# -- the backends -------------------------------------------------------------------------------


def _torch(spec: TrainerSpec, model_path: str | Path, seed: int, layout: RankLayout) -> TrainingEngine:
    from rollart.training.torch.engine import TorchTrainer

    if layout.world_size != 1:
        raise ConfigError(f"run.trainer.backend: torch trains on one device, not {layout.world_size} ranks")
    return TorchTrainer(model_path, spec, seed=seed)


def _fsdp2(spec: TrainerSpec, model_path: str | Path, seed: int, layout: RankLayout) -> TrainingEngine:
    from rollart.training.fsdp.engine import FSDPTrainer

    return FSDPTrainer(model_path, spec, seed=seed, layout=layout)


def _fsdp2_rank() -> RankMain:
    from rollart.training.fsdp.rank import rank_main

    return rank_main


def _megatron(spec: TrainerSpec, model_path: str | Path, seed: int, layout: RankLayout) -> TrainingEngine:
    from rollart.training.megatron.engine import MegatronTrainer

    return MegatronTrainer(model_path, spec, seed=seed, layout=layout)


def _megatron_rank() -> RankMain:
    from rollart.training.megatron.rank import rank_main

    return rank_main


TRAINING_BACKENDS: dict[str, TrainingBackend] = {
    "torch": TrainingBackend(_torch, lora=True),
    "fsdp2": TrainingBackend(_fsdp2, rank_main=_fsdp2_rank, node_groups=True, lora=True),
    "megatron": TrainingBackend(_megatron, rank_main=_megatron_rank, splits_layers=True),
}
"""`run.trainer.backend` -> its record."""
