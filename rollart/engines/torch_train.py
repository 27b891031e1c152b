"""The plain PyTorch training engine: one device, CPU or GPU, any Hugging Face causal LM.

The step itself is `rollart.engines.step.StepRunner` on a world of one rank, the code the FSDP2
ranks run: `epochs` passes over the batch, each split into `updates_per_batch` mini-batches (one
optimizer step each), each into micro-batches of `micro_batch_size` sequences (or
`micro_batch_tokens` padded tokens) whose gradients accumulate; log-probs through
`rollart.engines.logprobs.PolicyLogprobs`, the output head in chunks. bf16 autocast on GPUs that
have it (`precision: auto`); master weights and optimizer state fp32 unless `master_dtype: bf16`. A
reference model for the KL term is loaded only when `kl_coef > 0`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.engines import memory
from rollart.engines.loading import load_model_and_tokenizer
from rollart.engines.logprobs import PolicyLogprobs, policy_logprobs
from rollart.engines.step import StepRunner
from rollart.engines.training import TrainerSpec
from rollart.errors import RollartError

OPTIMIZER_FILE = "optimizer.pt"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def compute_dtype(spec: TrainerSpec, device: torch.device) -> torch.dtype | None:
    """The autocast dtype `precision` asks for on `device` (None: compute in the weights' dtype)."""
    if spec.master_dtype == "bf16":
        return None
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if spec.precision == "bf16" or (spec.precision == "auto" and bf16) else None


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
        dtype = torch.bfloat16 if spec.master_dtype == "bf16" else torch.float32
        lm, self.tokenizer = load_model_and_tokenizer(model_path, dtype=dtype, device=self.device)
        self.lm = lm
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
            self.model.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
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

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to(dtype or tensor.dtype) for name, tensor in self.lm.state_dict().items()}

    def exports_copies(self, dtype: torch.dtype | None = None) -> bool:
        return dtype is not None and all(tensor.dtype != dtype for tensor in self.lm.state_dict().values())

    def save(self, path: Path) -> Future[None]:
        """Write a Hugging Face model folder plus the optimizer state, atomically (staging + rename)."""
        staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        self.lm.save_pretrained(staging)
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
        lm, _ = load_model_and_tokenizer(path, device=self.device)
        self.lm.load_state_dict(lm.state_dict())
        state = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

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
            "reference_model": self.ref_model is not None,
        }
