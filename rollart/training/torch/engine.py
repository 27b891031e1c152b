"""The plain PyTorch training engine: one device, CPU or GPU, any Hugging Face causal LM.

The step itself is `rollart.training.step.StepRunner` on a world of one rank, the code the FSDP2
ranks run: `epochs` passes over the batch, each split into `updates_per_batch` mini-batches (one
optimizer step each), each into micro-batches of `micro_batch_size` sequences (or
`micro_batch_tokens` padded tokens) whose gradients accumulate; log-probs through
`rollart.training.logprobs.PolicyLogprobs`, the output head in chunks. bf16 autocast on GPUs that
have it (`precision: auto`); master weights and optimizer state fp32 unless `master_dtype: bf16`. A
reference model for the KL term is loaded only when `kl_coef > 0`.

With `lora` (`rollart.lora.adapters`) the base loads in `lora.base_dtype`, frozen, with PEFT's adapters
(fp32) on its target modules; AdamW holds state for the adapters alone, `export_weights` gives the
adapters alone (PEFT's names), and a checkpoint is the adapter folder (PEFT's format, never the base)
beside the optimizer state and `engine.json` (the LoRA settings and the base model's path).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.errors import RollartError
from rollart.models.loading import load_model_and_tokenizer
from rollart.training import memory
from rollart.training.devices import compute_dtype, pick_device
from rollart.training.layout import ENGINE_FILE, OPTIMIZER_FILE
from rollart.training.logprobs import PolicyLogprobs, policy_logprobs
from rollart.training.spec import TrainerSpec
from rollart.training.step import StepRunner


def done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class TorchTrainer:
    """GRPO steps on a Hugging Face model with AdamW (see the module docstring)."""

    def __init__(self, model_path: str | Path, spec: TrainerSpec, *, seed: int = 0) -> None:
        self.spec = spec
        self.device = pick_device(spec.device)
        if spec.threads and self.device.type == "cpu":
            torch.set_num_threads(spec.threads)
        torch.manual_seed(seed)
        self.model_path = Path(model_path).resolve()
        dtype = torch.bfloat16 if spec.master_dtype == "bf16" else torch.float32
        if spec.lora is not None:
            dtype = torch.bfloat16 if spec.lora.base_dtype == "bf16" else torch.float32
        lm, self.tokenizer = load_model_and_tokenizer(model_path, dtype=dtype, device=self.device)
        self.lm = lm
        self.peft_model = None
        if spec.lora is not None:
            from rollart.lora.adapters import apply_lora

            self.peft_model = apply_lora(lm, spec.lora)  # in place: lm's targeted layers now carry the adapters
        if spec.activation_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = PolicyLogprobs(lm, chunk_tokens=spec.logprob_chunk_tokens, share_reads=spec.share_reads).train()
        self.ref_model = None
        if spec.grpo.kl_coef > 0:
            ref, _ = load_model_and_tokenizer(model_path, dtype=dtype, device=self.device)
            self.ref_model = PolicyLogprobs(
                ref.requires_grad_(False), chunk_tokens=spec.logprob_chunk_tokens, share_reads=spec.share_reads
            )
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA the adapters alone
            lr=spec.lr,
            betas=spec.betas,
            weight_decay=spec.weight_decay,
        )
        self.autocast_dtype = compute_dtype(spec, self.device)
        self.runner = StepRunner(
            self.model,
            self.optimizer,
            spec,
            logprobs=policy_logprobs,
            ref_model=self.ref_model,
            autocast=self._autocast,
        )
        self.steps = 0

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        memory.reset_peak(self.device)
        out = self.runner.train_step(batch.to(self.device), version=version)
        self.steps += 1
        held = memory.state_bytes(self.model.parameters(), self.optimizer)
        out |= {"state_bytes_r0": held["state_bytes"], "peak_bytes_r0": memory.peak_bytes(self.device)}
        return out

    def _exported(self) -> dict[str, torch.Tensor]:
        """What leaves the engine: every weight by Hugging Face name, or with LoRA the adapters by PEFT's."""
        if self.spec.lora is not None:
            from rollart.lora.adapters import adapter_state

            return adapter_state(self.lm)
        return self.lm.state_dict()

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to(dtype or tensor.dtype) for name, tensor in self._exported().items()}

    def begin_export(self, dtype: torch.dtype | None = None) -> Future[dict[str, torch.Tensor]]:
        exported: Future[dict[str, torch.Tensor]] = Future()
        exported.set_running_or_notify_cancel()
        exported.set_result(self.export_weights(dtype))  # one process: the export is done when it returns
        return exported

    def exports_copies(self, dtype: torch.dtype | None = None) -> bool:
        return dtype is not None and all(tensor.dtype != dtype for tensor in self._exported().values())

    def save(self, path: Path) -> Future[None]:
        """Write a Hugging Face model folder (with LoRA: the adapter folder, the base's config and
        `engine.json`) plus the optimizer state, atomically (staging + rename)."""
        staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        if self.spec.lora is None:
            self.lm.save_pretrained(staging)
        else:
            from rollart.lora.adapters import spec_dict, write_peft_adapter

            write_peft_adapter(staging, self.export_weights(), self.spec.lora, self.model_path)
            self.lm.config.save_pretrained(staging)
            if self.lm.generation_config is not None:
                self.lm.generation_config.save_pretrained(staging)
            engine = {"steps": self.steps, "lora": spec_dict(self.spec.lora), "base_model": str(self.model_path)}
            (staging / ENGINE_FILE).write_text(json.dumps(engine))
        self.tokenizer.save_pretrained(staging)
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, staging / OPTIMIZER_FILE)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(staging, path)
        return done()

    def load(self, path: Path) -> None:
        if not (path / OPTIMIZER_FILE).exists():
            raise RollartError(
                f"{path} holds no {OPTIMIZER_FILE}: it was not written by the torch backend (fsdp2 writes "
                "dcp/ shards, loadable onto any number of ranks); resume with the backend that wrote it"
            )
        if self.spec.lora is not None:
            self._load_adapters(path)
        else:
            if (path / ENGINE_FILE).exists():
                raise RollartError(f"{path} holds LoRA adapters, and run.trainer.lora is not set: resume with it")
            lm, _ = load_model_and_tokenizer(path, device=self.device)
            self.lm.load_state_dict(lm.state_dict())
        state = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def _load_adapters(self, path: Path) -> None:
        from rollart.lora.adapters import ADAPTER_WEIGHTS, adapter_state, read_peft_adapter

        if not (path / ADAPTER_WEIGHTS).exists():
            raise RollartError(
                f"{path} holds no {ADAPTER_WEIGHTS}: it is a full checkpoint, and run.trainer.lora is set"
            )
        saved, live = read_peft_adapter(path), adapter_state(self.lm)
        if saved.keys() != live.keys():
            missing, extra = sorted(live.keys() - saved.keys()), sorted(saved.keys() - live.keys())
            raise RollartError(
                f"{path}: its adapters are not this engine's (run.trainer.lora changed?): missing {missing[:4]}, "
                f"unexpected {extra[:4]}"
            )
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(saved[name])

    def close(self) -> None:
        pass

    def failed(self) -> None:
        return None  # one process: nothing breaks between calls

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "torch",
            "device": str(self.device),
            "autocast": str(self.autocast_dtype) if self.autocast_dtype else "off",
            "master_dtype": self.spec.master_dtype,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "lora": None if self.spec.lora is None else f"rank {self.spec.lora.rank}, base {self.spec.lora.base_dtype}",
            "reference_model": self.ref_model is not None,
        }
