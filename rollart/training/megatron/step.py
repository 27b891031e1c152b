"""One GRPO step on a Megatron-Core model, as one rank runs it (`rollart.training.megatron.rank`).

The batch is planned as for FSDP2 (`rollart.training.step.plan_step`): mini-batches, rows dealt to the
data-parallel replicas by token count, each replica's rows cut into micro-batches (replicas with
fewer run empty ones, so every replica's optimizer step waits on the same number). Every rank of a
replica (its tensor-parallel ranks and pipeline stages) runs the same micro-batches through
Megatron's `get_forward_backward_func` schedule: 1F1B over the stages, or plain forward/backward
with one stage.

Log-probs come from the last stage's vocab-parallel logits without gathering the vocabulary
(`token_logprobs`): `vocab_parallel_cross_entropy` reduces the log-sum-exp and the sampled token's
logit over the tensor-parallel ranks, after Megatron's padded vocabulary rows are masked out. The
loss is the GRPO loss summed over a micro-batch's loss tokens; with `calculate_per_token_loss`
Megatron's `finalize_model_grads` sums gradients over replicas and divides by the mini-batch's loss
tokens over all replicas, which is the token mean `rollart.training.step` computes. Gradients are
clipped and applied by Megatron's optimizer (its norm reduces over the model-parallel shards).

pi_prox is the weights at the start of the step: mini-batch 0's first pass keeps its own log-probs,
later mini-batches get a forward-only pass before the first update. Statistics are summed on the
last stage's tensor-parallel rank 0 of each replica, then over all ranks (the others add zeros).
Not here: `share_reads`/`logprob_chunk_tokens` (every row goes through whole; the last stage holds
its micro-batch's logits over its vocabulary shard) and a reference model (kl_coef > 0).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rollart.algorithms.grpo import PackedBatch, grpo_loss, staleness
from rollart.algorithms.stats import LossStats
from rollart.training.step import StepTimes, World, empty_micro_batch, plan_step

if TYPE_CHECKING:
    from rollart.training.spec import TrainerSpec


def token_logprobs(logits: torch.Tensor, batch: PackedBatch, *, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """[N, T] log-probs of `batch`'s loss tokens (0 elsewhere) from this rank's vocabulary shard of
    the logits [N, T, V/tp]; every tensor-parallel rank gets the same. Rows of the padded vocabulary
    (ids >= `vocab_size`) get no probability."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # type: ignore[import-untyped]

    real = batch.loss_mask[:, 1:].to(logits.device) > 0
    picked = logits[:, :-1][real].float()  # [K, V/tp], a copy (the loss below works in place)
    picked = picked / batch.temperature[:, 1:].to(logits.device)[real].float()[:, None]  # the sampled distribution
    targets = batch.input_ids[:, 1:].to(logits.device)[real]
    width = logits.shape[-1]
    padded = torch.arange(tp_rank * width, (tp_rank + 1) * width, device=logits.device) >= vocab_size
    if bool(padded.any()):
        picked = picked.masked_fill(padded, float("-inf"))
    out = torch.zeros(real.shape, dtype=torch.float32, device=logits.device)
    if picked.shape[0] == 0:  # no loss token: still a graph through the logits, for the backward pass
        return torch.nn.functional.pad(out, (1, 0)) + 0.0 * logits.sum()
    logp: torch.Tensor = -vocab_parallel_cross_entropy(picked, targets)
    return torch.nn.functional.pad(out.masked_scatter(real, logp), (1, 0))


def causal_inputs(batch: PackedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTModel's inputs for right-padded rows: ids, positions and a causal mask (True: hidden), which
    is all padding needs (the padding comes after every real token)."""
    ids = batch.input_ids.to(device)
    width = ids.shape[1]
    positions = torch.arange(width, device=device).expand_as(ids)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]
    return ids, positions, causal


@dataclasses.dataclass
class MegatronStep:
    """Runs `train_step` for one rank of a Megatron model (module docstring)."""

    model: Any
    """The DDP-wrapped GPTModel (this rank's shard)."""
    optimizer: Any
    """Megatron's optimizer over it."""
    spec: TrainerSpec
    _: dataclasses.KW_ONLY
    vocab_size: int
    tp_rank: int
    last_stage: bool
    replicas: World
    """The data-parallel group: this rank's replica among how many (how `plan_step` deals rows)."""
    device: torch.device

    def _run(self, micro: list[PackedBatch], *, forward_only: bool, on_logprobs: Any) -> None:
        """Micro-batches through the schedule; on the last stage `on_logprobs(k, mb, logprobs)` gives
        micro-batch k's loss sum and its loss-token count."""
        from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped]

        def forward_step(data: Iterator[tuple[int, PackedBatch]], model: Any) -> tuple[torch.Tensor, Any]:
            k, mb = next(data)
            output: torch.Tensor = model(*causal_inputs(mb, self.device))

            def loss(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                logp = token_logprobs(out, mb, vocab_size=self.vocab_size, tp_rank=self.tp_rank)
                total, tokens = on_logprobs(k, mb, logp)
                return total, tokens, {}

            return output, loss

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(enumerate(micro)),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=max(mb.input_ids.shape[1] for mb in micro),
            micro_batch_size=max(len(mb) for mb in micro),
            forward_only=forward_only,
        )

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        started = time.perf_counter()
        spec, device = self.spec, self.device
        plans = plan_step(batch, spec, self.replicas)
        micros = [[empty_micro_batch(batch) if mb is None else mb for mb in plan.micro] for plan in plans]
        reals = [[mb is not None for mb in plan.micro] for plan in plans]
        times = StepTimes(device=device)
        prox: dict[int, list[torch.Tensor]] = {0: []}

        def keep(index: int) -> Any:
            def on_logprobs(k: int, mb: PackedBatch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                prox[index].append(logp.detach())
                return logp.sum() * 0.0, torch.zeros((), dtype=torch.int, device=device)

            return on_logprobs

        for index in range(1, len(plans)):
            prox[index] = []
            with torch.no_grad():
                self._run(micros[index], forward_only=True, on_logprobs=keep(index))
        times.lap("recompute_s")
        total: list[LossStats] = []
        grad_norms = []
        for epoch, index in itertools.product(range(spec.epochs), range(len(plans))):
            first = epoch == index == 0
            score = self._scorer(prox, index, keep_prox=first, real=reals[index], total=total, version=version)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._run(micros[index], forward_only=False, on_logprobs=score)
            times.lap("backward_s")  # forward and backward interleave in the schedule
            _, norm, _ = self.optimizer.step()
            grad_norms.append(float(norm) if norm is not None else 0.0)
            times.lap("optimizer_s")
        out = self._reduce(total) | times.stats()
        out["grad_norm"] = max(grad_norms)
        out |= staleness(batch.versions, batch.loss_mask, version)
        out["tokens"] = float(batch.loss_tokens)
        out["passes"] = float(spec.epochs)
        out["train_s"] = time.perf_counter() - started
        return out

    def _scorer(
        self,
        prox: dict[int, list[torch.Tensor]],
        index: int,
        *,
        keep_prox: bool,
        real: list[bool],
        total: list[LossStats],
        version: int,
    ) -> Any:
        """Mini-batch `index`'s loss: the GRPO loss summed over a micro-batch's loss tokens, with their
        count (the token mean's denominator Megatron sums over replicas); its statistics go to `total`."""
        device, spec = self.device, self.spec

        def score(k: int, mb: PackedBatch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if keep_prox:
                prox[0].append(logp.detach())
            loss, stats = grpo_loss(logp, prox[index][k], mb.to(device), spec.grpo, total_tokens=1, version=version)
            if real[k]:
                total.append(stats)
            return loss, mb.loss_mask.sum().to(device=device, dtype=torch.int)

        return score

    def _reduce(self, total: list[LossStats]) -> dict[str, float]:
        """The loss statistics summed over micro-batches and replicas (module docstring)."""
        summed = LossStats.zeros(self.device)
        if total and self.last_stage and self.tp_rank == 0:
            summed = functools.reduce(operator.add, total)
        sums, peaks = summed.split(self.device, torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out = LossStats.joined(sums, peaks).means()
        grpo = self.spec.grpo
        out["loss"] = out["policy_loss"] + grpo.kl_coef * out["kl"] + grpo.anchor_coef * out["anchor_kl"]
        return out
