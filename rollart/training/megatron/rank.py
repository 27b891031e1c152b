"""One Megatron-Core training rank: a process that holds one (tensor, pipeline, data) shard of the policy.

`rank_main` is the process's entry point: `rollart.training.ranks.group.RankGroup` starts it for
`run.trainer.backend: megatron` and drives it exactly as it drives FSDP2 ranks (the same rendezvous,
the same commands from rank 0's pipe, broadcast to every rank; `rollart.training.fsdp.rank`). The rank
joins an NCCL group, splits it with `parallel_state.initialize_model_parallel(tp, pp)` (data
parallel is what is left), builds its `GPTModel` shard from the Hugging Face checkpoint
(`rollart.training.megatron.convert`, reading only its own tensors), wraps it in Megatron's
`DistributedDataParallel` and its distributed optimizer (fp32 master weights and Adam state sharded
over the replicas), and serves:

- `train` (batch, version): the step (`rollart.training.megatron.step`) and its statistics;
- `export_bytes` (dtype), `export` (target, dtype): the weights by HF name, full tensors, written by rank 0
  into the node's shared buffer (`rollart.training.ranks.export`); each parameter's
  tensor-parallel shards are gathered on its stage and sent to rank 0, which un-fuses them;
- `save` (folder): a Hugging Face model folder (loadable as run.model.path with any tp/pp) plus
  each model-parallel shard's optimizer state (`megatron_optim/`, restored only by the same tp x pp);
- `load` (folder), `describe`, `stop`.

GPUs only: Megatron-Core 0.16's forward needs CUDA (the engine refuses a machine without it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollart.algorithms.grpo import PackedBatch
from rollart.errors import RollartError
from rollart.models.checkpoint import checkpoint_shapes
from rollart.training.devices import compute_dtype
from rollart.training.layout import ENGINE_FILE, MEGATRON_OPTIM_FOLDER
from rollart.training.megatron.convert import (
    EMBEDDING,
    OUTPUT,
    Parallel,
    Param,
    architecture,
    to_hf,
    to_megatron,
)
from rollart.training.megatron.step import MegatronStep
from rollart.training.ranks.export import ExportTarget, Placed, SharedExport, export_nbytes
from rollart.training.ranks.process import CommandLoop, RankArgs, enter_group, leave_group
from rollart.training.spec import TrainerSpec
from rollart.training.step import World

WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".pt")


class HFWeights(Mapping[str, torch.Tensor]):
    """A Hugging Face folder's safetensors by name, each read when asked for."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Any] = {}
        for file in sorted(folder.glob("*.safetensors")):
            handle = safe_open(str(file), framework="pt")
            self.files |= dict.fromkeys(handle.keys(), handle)  # type: ignore[no-untyped-call]

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self.files[name].get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def rank_main(args: RankArgs, commands: Connection | None, alive: Connection) -> None:
    """The rank process (module docstring); `commands` is rank 0's pipe to its node, None elsewhere."""
    spec = args.spec
    device = torch.device("cuda", args.local_rank)
    torch.cuda.set_device(device)
    enter_group(args, device, alive)
    with warnings.catch_warnings():  # Transformer Engine and Apex absent: the local layer spec is used
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel  # type: ignore[import-untyped]
    try:
        parallel_state.initialize_model_parallel(spec.tensor_parallel, spec.pipeline_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        MegatronRank(spec, Path(args.model_path), device=device).serve(commands)
    finally:
        with contextlib.suppress(Exception):
            parallel_state.destroy_model_parallel()
        leave_group()


class MegatronRank(CommandLoop):
    """This rank's model shard, its optimizer and the commands it serves."""

    def __init__(self, spec: TrainerSpec, model_path: Path, *, device: torch.device) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (  # type: ignore[import-untyped]
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped]
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # type: ignore[import-untyped]
        from megatron.core.transformer.transformer_config import TransformerConfig  # type: ignore[import-untyped]

        from rollart.training.megatron.convert import gpt_model_kwargs, transformer_config_kwargs

        self.spec, self.device, self.model_path = spec, device, model_path
        self.rank = dist.get_rank()
        self.config = json.loads((model_path / "config.json").read_text())
        self.arch = architecture(self.config)
        self.parallel = Parallel(tp=spec.tensor_parallel, pp=spec.pipeline_parallel)
        self.tp_rank, self.stage = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        bf16 = compute_dtype(spec, device) == torch.bfloat16
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        recompute = (
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if spec.activation_checkpointing
            else {}
        )
        config = TransformerConfig(
            **transformer_config_kwargs(self.arch),
            **recompute,
            tensor_model_parallel_size=self.parallel.tp,
            pipeline_model_parallel_size=self.parallel.pp,
            params_dtype=self.dtype,
            pipeline_dtype=self.dtype,
            bf16=bf16,
            variable_seq_lengths=True,  # micro-batches differ in rows and width; stages send shapes first
            moe_token_dispatcher_type="alltoall",  # no experts; the default one refuses variable lengths
            calculate_per_token_loss=True,  # step.py: sum over replicas, divide by loss tokens
            perform_initialization=False,  # the checkpoint's weights replace whatever it would draw
        )
        layers = get_gpt_layer_local_spec(qk_layernorm=self.arch.qk_norm, normalization="RMSNorm")
        self.gpt = GPTModel(
            config,
            layers,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            **gpt_model_kwargs(self.arch, self.parallel),
        )
        self._load_weights(model_path)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.model = DistributedDataParallel(config, ddp, self.gpt)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=spec.lr,
                weight_decay=spec.weight_decay,
                adam_beta1=spec.betas[0],
                adam_beta2=spec.betas[1],
                clip_grad=spec.grad_clip,
                bf16=bf16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )
        self.step = MegatronStep(
            self.model,
            self.optimizer,
            spec,
            vocab_size=self.arch.vocab_size,
            tp_rank=self.tp_rank,
            last_stage=ps.is_pipeline_last_stage(),
            replicas=World(rank=self.dp_rank, size=self.dp_size, group=ps.get_data_parallel_group(), device=device),
            device=device,
        )
        self.steps = 0
        # Who holds what, for `export`: every rank's (tp, stage, dp) and its parameters' shapes.
        mine = (self.tp_rank, self.stage, self.dp_rank, {n: tuple(p.shape) for n, p in self.gpt.named_parameters()})
        self.ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(self.ranks, mine)

    def _load_weights(self, folder: Path) -> None:
        state = to_megatron(HFWeights(folder), self.arch, self.parallel, tp_rank=self.tp_rank, stage=self.stage)
        self.gpt.load_state_dict(state, strict=True)  # copied onto the GPU in the model's dtype

    def do_describe(self, call: int) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "world_size": dist.get_world_size(),
            "tensor_parallel": self.parallel.tp,
            "pipeline_parallel": self.parallel.pp,
            "data_parallel": self.dp_size,
            "parameters_rank0": sum(p.numel() for p in self.gpt.parameters()),
            "padded_vocab": self.gpt.vocab_size,
        }

    def do_train(self, call: int, batch: PackedBatch, version: int) -> dict[str, float]:
        out = self.step.train_step(batch, version=version)
        self.steps += 1
        return out

    # -- weights out ------------------------------------------------------------------------------

    def _gather(self, param: Param, dtype: torch.dtype | None) -> list[torch.Tensor] | None:
        """`param`'s TP shards on rank 0 (None elsewhere): gathered on its stage by replica 0, whose
        tensor-parallel rank 0 sends them to rank 0 when that stage is not rank 0's."""
        stage = param.stages(self.arch, self.parallel)[0]
        name = param.local_name(self.arch, self.parallel)
        shards: list[torch.Tensor] | None = None
        if self.stage == stage and self.dp_rank == 0:
            local = dict(self.gpt.named_parameters())[name].detach()
            if param.kind == "replicated":
                shards = [local] * self.parallel.tp
            else:
                shards = [torch.empty_like(local) for _ in range(self.parallel.tp)]
                dist.all_gather(shards, local.contiguous(), group=self.tp_group)
            if self.rank != 0:
                if self.tp_rank == 0:
                    for shard in shards:
                        dist.send(shard.contiguous(), dst=0)
                return None
        elif self.rank == 0:
            source = next(r for r, (tp, st, dp, _) in enumerate(self.ranks) if (tp, st, dp) == (0, stage, 0))
            shape = self.ranks[source][3][name]
            shards = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.parallel.tp)]
            for shard in shards:
                dist.recv(shard, src=source)
        if shards is None:
            return None
        return [shard.to("cpu", dtype=dtype or shard.dtype) for shard in shards]

    def weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights by HF name on rank 0, in HF order (every rank must run it through)."""
        return to_hf(self.arch, lambda param: self._gather(param, dtype))

    def do_export_bytes(self, call: int, dtype: torch.dtype | None) -> int:
        """Bytes an export in `dtype` needs, from the HF shapes of the architecture (nothing is gathered)."""
        shapes = checkpoint_shapes(Path(self.model_path))  # the HF names and shapes the export gives
        if self.arch.tied_embeddings:
            shapes.setdefault(OUTPUT.hf[0], shapes[EMBEDDING.hf[0]])
        return export_nbytes(((shape, self.dtype) for shape in shapes.values()), dtype)

    def do_export(self, call: int, target: ExportTarget, dtype: torch.dtype | None) -> list[Placed] | None:
        """The weights by HF name, written by rank 0 into the node's shared buffer as they are gathered
        (`rollart.training.ranks.export`); rank 0 answers where each one lies."""
        sink = SharedExport(target, self.device) if self.rank == 0 else None
        for name, tensor in self.weights(dtype):
            if sink is not None:
                sink.write(name, tensor)
        return sink.finish() if sink is not None else None

    # -- checkpoints ------------------------------------------------------------------------------

    def _optim_file(self, folder: Path) -> Path:
        return folder / MEGATRON_OPTIM_FOLDER / f"tp{self.tp_rank}-pp{self.stage}.pt"

    def do_save(self, call: int, folder: str) -> str:
        """Written before it answers (module docstring): the HF folder first, staged and renamed."""
        from safetensors.torch import save_file

        path = Path(folder)
        staging = path.with_name(f".{path.name}.staging")
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(
                self.model_path, staging, ignore=lambda _, names: [n for n in names if n.endswith(WEIGHT_FILES)]
            )
            (staging / MEGATRON_OPTIM_FOLDER).mkdir()
        dist.barrier()
        weights = dict(self.weights())
        if self.rank == 0:
            if self.arch.tied_embeddings:
                weights.pop(OUTPUT.hf[0])  # HF writes a tied head once, as the embedding
            save_file({n: t.contiguous() for n, t in weights.items()}, str(staging / "model.safetensors"))
        layout = {"tensor_parallel": self.parallel.tp, "pipeline_parallel": self.parallel.pp}
        state = self.optimizer.state_dict()
        self.optimizer.save_parameter_state(str(self._optim_file(staging)) + ".params")  # gathered on dp rank 0
        if self.dp_rank == 0:
            torch.save(state, self._optim_file(staging))
        dist.barrier()
        if self.rank == 0:
            (staging / ENGINE_FILE).write_text(json.dumps({"steps": self.steps, **layout}))
            shutil.rmtree(path, ignore_errors=True)
            staging.rename(path)
            self._reply(call, "saved", str(path))
        return "written"

    def do_load(self, call: int, folder: str) -> int:
        path = Path(folder)
        engine = json.loads((path / ENGINE_FILE).read_text())
        if (engine.get("tensor_parallel"), engine.get("pipeline_parallel")) != (self.parallel.tp, self.parallel.pp):
            raise RollartError(
                f"{path}'s optimizer state is split tensor_parallel={engine.get('tensor_parallel')} x "
                f"pipeline_parallel={engine.get('pipeline_parallel')}, not {self.parallel.tp} x {self.parallel.pp}: "
                "resume with that split, or start a new run from its weights (run.model.path: the folder)"
            )
        # Without no_grad, the distributed optimizer's copy into its fp32 master weights (views of leaves
        # that require grad) raised on the GPU: "a view of a leaf Variable ... in-place operation".
        with torch.no_grad():
            self._load_weights(path)
            self.optimizer.reload_model_params()  # the fp32 master weights from the loaded ones
            self.optimizer.load_state_dict(torch.load(self._optim_file(path), map_location="cpu", weights_only=False))
            # With torch's Adam (no Transformer Engine or Apex), the state holds a "step" the parameter
            # file lacks, and megatron-core 0.16's load copies every key of the state from that file
            # (KeyError: 'step', on the GPU): the step comes from load_state_dict; set it aside meanwhile.
            inner = [chained.optimizer for chained in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
            steps = [(state, state.pop("step")) for opt in inner for state in opt.state.values() if "step" in state]
            self.optimizer.load_parameter_state(str(self._optim_file(path)) + ".params")
            for state, step in steps:
                state["step"] = step
        self.steps = int(engine["steps"])
        return self.steps
