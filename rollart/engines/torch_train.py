"""The plain PyTorch training engine: one device, CPU or GPU, any Hugging Face causal LM.

A step makes `epochs` passes over the batch, each split into `updates_per_batch` mini-batches (one
optimizer step each), each mini-batch into micro-batches of `micro_batch_size` sequences whose
gradients accumulate. The proximal log-probs (pi_prox of the decoupled PPO loss,
`rollart.algorithms.grpo`) are the weights at the start of the step; for the first update they
equal the new log-probs before it, so that update needs no extra no-grad forward pass. bf16 autocast on GPUs that have
it (`precision: auto`); master weights and optimizer state stay fp32. A reference model for the KL
term is loaded only when `kl_coef > 0`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rollart.algorithms.grpo import LossStats, PackedBatch, grpo_loss, staleness, token_logprobs
from rollart.engines.loading import load_model_and_tokenizer
from rollart.engines.training import TrainerSpec

OPTIMIZER_FILE = "optimizer.pt"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TorchTrainer:
    """GRPO steps on a Hugging Face model with AdamW (see the module docstring)."""

    def __init__(self, model_path: str | Path, spec: TrainerSpec, *, seed: int = 0) -> None:
        self.spec = spec
        self.device = pick_device(spec.device)
        if spec.threads and self.device.type == "cpu":
            torch.set_num_threads(spec.threads)
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_model_and_tokenizer(model_path, device=self.device)
        self.model.train()
        self.ref_model = None
        if spec.grpo.kl_coef > 0:
            self.ref_model, _ = load_model_and_tokenizer(model_path, device=self.device)
            self.ref_model.requires_grad_(False)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
        bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        use_bf16 = spec.precision == "bf16" or (spec.precision == "auto" and bf16)
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.steps = 0

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _logprobs(self, model: Any, mb: PackedBatch) -> torch.Tensor:
        with self._autocast():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        return token_logprobs(logits, mb.input_ids)

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        started = time.perf_counter()
        spec = self.spec
        batch = batch.to(self.device)
        rows = len(batch)
        per_update = -(-rows // spec.updates_per_batch)
        total_stats: LossStats | None = None
        grad_norms = []
        minis = list(batch.micro_batches(per_update))
        # pi_prox: the weights at the start of the step, for every update after the first.
        later = range(0 if spec.epochs > 1 else 1, len(minis))
        with torch.no_grad():
            prox_at_start = {
                index: [self._logprobs(self.model, mb) for mb in minis[index].micro_batches(spec.micro_batch_size)]
                for index in later
            }
        for epoch, (index, mini) in itertools.product(range(spec.epochs), enumerate(minis)):
            total_tokens = max(mini.loss_tokens, 1)
            self.optimizer.zero_grad(set_to_none=True)
            for k, mb in enumerate(mini.micro_batches(spec.micro_batch_size)):
                new = self._logprobs(self.model, mb)
                prox = new.detach() if epoch == index == 0 else prox_at_start[index][k]
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = self._logprobs(self.ref_model, mb)
                loss, stats = grpo_loss(new, prox, mb, spec.grpo, total_tokens=total_tokens, ref_logprobs=ref)
                loss.backward()  # type: ignore[no-untyped-call]
                total_stats = stats if total_stats is None else total_stats + stats
            clip = spec.grad_clip if spec.grad_clip > 0 else float("inf")
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)))
            self.optimizer.step()
        self.steps += 1
        assert total_stats is not None
        out = total_stats.means()
        out["loss"] = out["policy_loss"] + spec.grpo.kl_coef * out["kl"] + spec.grpo.anchor_coef * out["anchor_kl"]
        out["grad_norm"] = max(grad_norms)
        out |= staleness(batch.versions, batch.loss_mask, version)
        out["tokens"] = float(batch.loss_tokens)
        out["train_s"] = time.perf_counter() - started
        return out

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save(self, path: Path) -> None:
        """Write a Hugging Face model folder plus the optimizer state, atomically (staging + rename)."""
        staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(staging)
        self.tokenizer.save_pretrained(staging)
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, staging / OPTIMIZER_FILE)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(staging, path)

    def load(self, path: Path) -> None:
        model, _ = load_model_and_tokenizer(path, device=self.device)
        self.model.load_state_dict(model.state_dict())
        state = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "torch",
            "device": str(self.device),
            "autocast": str(self.autocast_dtype) if self.autocast_dtype else "off",
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "reference_model": self.ref_model is not None,
        }
