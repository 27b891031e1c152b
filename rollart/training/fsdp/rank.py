"""One FSDP2 training rank: a process that holds a shard of the policy and its optimizer state.

`rank_main` is the process's entry point (`rollart.training.ranks.group.RankGroup` starts it). The
rank joins the process group through the trainer's rendezvous store (never a generation it joined in
an earlier life: `join`), loads the model, shards every
decoder layer and then the whole policy with `fully_shard`, and serves commands. Rank 0 reads them
from its pipe to the trainer node and broadcasts each to the other ranks, so every rank runs the
same collectives in the same order; rank 0 answers. The other ranks' pipes only tell them that their
node is gone: a rank whose node died exits at once rather than wait in a collective.

Commands (a tuple: name, call id, arguments), and what rank 0 answers:
- `train` (batch, version): the step's statistics, with every rank's model-state and peak bytes;
- `export_bytes` (dtype): how many bytes an export in that dtype needs;
- `export` (target, dtype): the weights by Hugging Face name, cast on the device and gathered whole a bucket
  at a time (`rollart.training.fsdp.gather`), written by rank 0 straight into the node's shared-memory buffer
  (`rollart.training.ranks.export`): the answer says where each one lies, and nothing else crosses the pipe;
- `save` (folder): answered once the shards are staged in memory; the write goes on in the
  background (`torch.distributed.checkpoint.async_save` on a process group of its own) and a second
  answer under the same id says when the folder is complete (written to a staging name, renamed);
- `load` (folder): restores weights and optimizer state whatever rank count wrote them;
- `stop`: every rank leaves the group and exits.

With `lora` every rank puts PEFT's adapters on its model before sharding it (`fully_shard` shards the
frozen base and the trainable adapters alike), AdamW holds the adapters' state alone, `export` sends the
adapters alone (PEFT's names), and the checkpoint's shards hold the adapters and their optimizer state,
not the base (`ignore_frozen_params`): `engine.json` names the base model and the LoRA settings.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rollart.algorithms.grpo import PackedBatch
from rollart.models.loading import load_model_and_tokenizer
from rollart.training import memory
from rollart.training.devices import compute_dtype, pick_device
from rollart.training.fsdp.gather import whole_tensors
from rollart.training.layout import DCP_FOLDER, ENGINE_FILE
from rollart.training.logprobs import PolicyLogprobs, policy_logprobs
from rollart.training.ranks.export import ExportTarget, Placed, SharedExport, export_nbytes
from rollart.training.ranks.process import CommandLoop, RankArgs, enter_group, leave_group
from rollart.training.spec import TrainerSpec
from rollart.training.step import StepRunner, World


def rank_main(args: RankArgs, commands: Connection | None, alive: Connection) -> None:
    """The rank process (module docstring); `commands` is rank 0's pipe to its node, None elsewhere."""
    spec = args.spec
    device = pick_device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", args.local_rank)
        torch.cuda.set_device(device)
    elif spec.threads:
        torch.set_num_threads(spec.threads)
    else:  # the cores this node may use (its share of the machine, when pinned), divided among its ranks
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // spec.ranks))
    enter_group(args, device, alive)
    try:
        Rank(spec, args.model_path, seed=args.seed, device=device, world_size=args.world_size).serve(commands)
    finally:
        leave_group()


def shard(model: torch.nn.Module, lm: Any, mp: MixedPrecisionPolicy) -> None:
    """FSDP2 per decoder layer, then the whole policy (embeddings, final norm and head at the root);
    gradients summed over ranks, not averaged (`rollart.training.step`)."""
    for layer in lm.get_decoder().layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


class Rank(CommandLoop):
    """The policy shard, its optimizer and the commands it serves."""

    def __init__(self, spec: TrainerSpec, model_path: str, *, seed: int, device: torch.device, world_size: int) -> None:
        torch.manual_seed(seed)
        self.spec, self.device, self.rank = spec, device, dist.get_rank()
        self.world = World(rank=self.rank, size=world_size, device=device)
        self.model_path = str(Path(model_path).resolve())
        dtype = torch.bfloat16 if spec.master_dtype == "bf16" else torch.float32
        if spec.lora is not None:
            dtype = torch.bfloat16 if spec.lora.base_dtype == "bf16" else torch.float32
        compute = compute_dtype(spec, device)
        mp = (
            MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
        )
        self.lm, self.tokenizer = load_model_and_tokenizer(model_path, dtype=dtype)
        if spec.lora is not None:
            from rollart.lora.adapters import apply_lora

            apply_lora(self.lm, spec.lora)  # before sharding: the same adapters (same seed) on every rank
        if spec.activation_checkpointing:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # every rank runs the decoder once per micro-batch: its layers' forwards are collectives
        self.model = PolicyLogprobs(
            self.lm.train(), chunk_tokens=spec.logprob_chunk_tokens, share_reads=spec.share_reads, share_heads=False
        )
        shard(self.model, self.lm, mp)
        ref = None
        if spec.grpo.kl_coef > 0:
            ref_lm, _ = load_model_and_tokenizer(model_path, dtype=dtype)
            ref = PolicyLogprobs(
                ref_lm.requires_grad_(False),
                chunk_tokens=spec.logprob_chunk_tokens,
                share_reads=spec.share_reads,
                share_heads=False,
            )
            shard(ref, ref_lm, mp)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA the adapters alone
            lr=spec.lr,
            betas=spec.betas,
            weight_decay=spec.weight_decay,
        )
        self.runner = StepRunner(
            self.model, self.optimizer, spec, logprobs=policy_logprobs, world=self.world, ref_model=ref
        )
        self.steps = 0
        self.checkpoint_group = dist.new_group(backend="gloo")
        """Background checkpoint writes run their collectives here, apart from training's."""
        self._saving: Future[Any] | None = None

    def before_stop(self) -> None:
        self._wait_saved()

    def describe(self) -> dict[str, Any]:
        return {
            "parameters": sum(p.numel() for p in self.lm.parameters()),
            "trainable_parameters": sum(p.numel() for p in self.lm.parameters() if p.requires_grad),
            "device": str(self.device),
            "world_size": self.world.size,
        }

    def do_describe(self, call: int) -> dict[str, Any]:
        return self.describe()

    def do_train(self, call: int, batch: PackedBatch, version: int) -> dict[str, float]:
        memory.reset_peak(self.device)
        out = self.runner.train_step(batch.to(self.device), version=version)
        self.steps += 1
        mine = torch.tensor(
            [
                memory.state_bytes(self.model.parameters(), self.optimizer)["state_bytes"],
                memory.peak_bytes(self.device),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        every = [torch.zeros_like(mine) for _ in range(self.world.size)]
        dist.all_gather(every, mine)
        for r, held in enumerate(every):
            out[f"state_bytes_r{r}"], out[f"peak_bytes_r{r}"] = (float(v) for v in held.tolist())
        return out

    def _exported_state(self) -> dict[str, torch.Tensor]:
        if self.spec.lora is not None:
            from rollart.lora.adapters import adapter_state

            return adapter_state(self.lm)
        return self.lm.state_dict()

    def do_export_bytes(self, call: int, dtype: torch.dtype | None) -> int:
        """Bytes an export in `dtype` needs (from the weights' global shapes: nothing is gathered)."""
        return export_nbytes(((tuple(t.shape), t.dtype) for t in self._exported_state().values()), dtype)

    def do_export(self, call: int, target: ExportTarget, dtype: torch.dtype | None) -> list[Placed] | None:
        """Gather the weights whole, a bucket at a time, cast on the device (`rollart.training.fsdp.gather`), and
        have rank 0 write each into the node's shared buffer (module docstring); rank 0 answers where each lies."""
        sink = SharedExport(target, self.device) if self.rank == 0 else None
        whole_tensors(
            self._exported_state().items(),
            sink.place if sink is not None else None,
            dtype=dtype,
            bucket_bytes=self.spec.weights.bucket_bytes,
            rank=self.rank,
            world=self.world.size,
        )
        return sink.finish() if sink is not None else None

    def do_full_state(self, call: int) -> dict[str, Any] | None:
        """The whole model and optimizer state by name on rank 0, on CPU (for tests and small models:
        it holds everything at once, which `export` and `save` never do)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optim = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model, "optim": optim} if self.rank == 0 else None

    # -- checkpoints ------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """The checkpoint's state: with LoRA the adapters and their optimizer state, not the frozen base
        (`ignore_frozen_params` alone would keep a tied output head, a second name of the frozen embedding)."""
        lora = self.spec.lora is not None
        model, optim = get_state_dict(self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=lora))
        if lora:
            from rollart.lora.adapters import is_adapter

            model = {name: tensor for name, tensor in model.items() if is_adapter(name)}
        return {"model": model, "optim": optim}

    def do_save(self, call: int, folder: str) -> str:
        self._wait_saved()
        path = Path(folder)
        staging = path.with_name(f".{path.name}.staging")
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            self.lm.config.save_pretrained(staging)
            if self.lm.generation_config is not None:  # what `rollart export` gives the exported model
                self.lm.generation_config.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
            engine: dict[str, Any] = {"steps": self.steps, "world_size": self.world.size}
            if self.spec.lora is not None:
                from rollart.lora.adapters import spec_dict

                engine |= {"lora": spec_dict(self.spec.lora), "base_model": self.model_path}
            (staging / ENGINE_FILE).write_text(json.dumps(engine))
        dist.barrier()
        future: Future[Any] = async_save(  # type: ignore[assignment]
            self._state(), checkpoint_id=str(staging / DCP_FOLDER), process_group=self.checkpoint_group
        )
        self._saving = future
        future.add_done_callback(lambda done: self._saved(done, call, staging, path))
        return "staged"

    def _saved(self, done: Future[Any], call: int, staging: Path, path: Path) -> None:
        if self.rank != 0:
            return
        error = done.exception()
        if error is None:
            shutil.rmtree(path, ignore_errors=True)
            os.rename(staging, path)
        self._reply(call, "saved" if error is None else "error", repr(error) if error else str(path))

    def _wait_saved(self) -> None:
        if self._saving is not None:
            self._saving.result()
            self._saving = None

    def do_load(self, call: int, folder: str) -> int:
        self._wait_saved()
        path = Path(folder)
        state = self._state()
        dcp_load(state, checkpoint_id=str(path / DCP_FOLDER))
        # with LoRA the state holds the adapters (dcp_load fails on any it lacks); the base stays as loaded
        lora = self.spec.lora is not None
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=lora, strict=not lora),
        )
        self.steps = int(json.loads((path / ENGINE_FILE).read_text())["steps"])
        return self.steps
