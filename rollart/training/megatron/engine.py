"""The Megatron-Core training engine (`run.trainer.backend: megatron`): the trainer node's side of its ranks.

Like the FSDP2 engine it starts one process per GPU through `rollart.training.ranks.group.RankGroup`
(which starts `rollart.training.megatron.rank.rank_main` for this backend) and drives them by rank 0:
the batch goes down whole, statistics come back summed, weights come back bucket by bucket in
Hugging Face names (each tensor gathered over its tensor-parallel ranks and pipeline stage and
un-fused, `rollart.training.megatron.convert`). The group's ranks are tensor_parallel x
pipeline_parallel x data parallel, data parallel being what is left of `RankLayout.world_size`.

Checkpoints are Hugging Face model folders (any split can start from one) plus each model-parallel
shard's optimizer state, which only the same split restores (`rollart.training.megatron.rank`).

Megatron-Core 0.16's forward needs CUDA (RoPE, its RNG tracker, the default masks), so building the
engine without GPUs raises a ConfigError; its weight conversion is tested on CPU
(tests/unit/test_megatron_convert.py), the engine itself on a GPU (tests/integration/test_megatron_gpu.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rollart.errors import ConfigError, RollartError
from rollart.training.layout import ENGINE_FILE, MEGATRON_OPTIM_FOLDER
from rollart.training.megatron.convert import Parallel, architecture, check_parallel
from rollart.training.megatron.rank import rank_main
from rollart.training.ranks.engine import RankGroupEngine
from rollart.training.spec import RankLayout, TrainerSpec

NO_CUDA = (
    "run.trainer.backend: the megatron backend needs CUDA GPUs (Megatron-Core's forward pass runs on CUDA only); "
    "its weight conversion is tested on CPU, but training on this machine needs backend torch or fsdp2"
)


def check_megatron(spec: TrainerSpec, model_path: str | Path, layout: RankLayout) -> None:
    """Raise ConfigError (naming the run.trainer field) for what this backend cannot run here."""
    if spec.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError(NO_CUDA)
    if torch.cuda.device_count() < layout.local_ranks:
        raise ConfigError(
            f"run.trainer.ranks: {layout.local_ranks} ranks on this node, but it has "
            f"{torch.cuda.device_count()} GPUs (megatron runs one rank per GPU)"
        )
    problems = []
    split = spec.tensor_parallel * spec.pipeline_parallel
    if layout.world_size % split:
        problems.append(
            f"run.trainer.pipeline_parallel: tensor_parallel x pipeline_parallel = {split} must divide the "
            f"group's {layout.world_size} ranks"
        )
    if spec.grpo.kl_coef > 0:
        problems.append("run.trainer.grpo.kl_coef: the megatron backend has no reference model; use 0")
    if spec.master_dtype != "fp32":
        problems.append("run.trainer.master_dtype: the megatron backend keeps fp32 master weights (its optimizer)")
    config = json.loads((Path(model_path) / "config.json").read_text())
    arch = architecture(config)  # ConfigError naming what cannot be converted
    parallel = Parallel(tp=spec.tensor_parallel, pp=spec.pipeline_parallel)
    problems += [f"run.trainer.{field}: {problem}" for field, problem in check_parallel(arch, parallel)]
    if problems:
        raise ConfigError("; ".join(problems))


class MegatronTrainer(RankGroupEngine):
    """Drives this node's Megatron-Core ranks (module docstring); it owns rank 0, so it is the primary."""

    backend = "megatron"

    def __init__(self, model_path: str | Path, spec: TrainerSpec, *, seed: int, layout: RankLayout) -> None:
        check_megatron(spec, model_path, layout)
        super().__init__(model_path, spec, seed=seed, layout=layout, entry=rank_main)

    def load(self, path: Path) -> None:
        if not (path / ENGINE_FILE).is_file() or not (path / MEGATRON_OPTIM_FOLDER).is_dir():
            raise RollartError(
                f"{path} was not written by the megatron backend; resume with the backend that wrote it, "
                "or start a new run from a Hugging Face folder with run.model.path"
            )
        self.ranks.call("load", str(path))
