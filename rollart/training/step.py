"""One GRPO training step as one rank runs it: the same code for one device and for N FSDP2 ranks.

Every rank holds the whole packed batch (batches are small next to a model) and computes the same
plan from it, so no rank waits on another to learn its share:

- the batch is cut into `updates_per_batch` mini-batches (one optimizer step each), as on one device;
- rows whose log-probs read the same prefix (`rollart.training.logprobs.shared_reads`) stay
  together, to go through the decoder once (`share_reads`); in what follows a row is such a group;
- each mini-batch's rows go to the ranks by token count (`split_rows`: longest first to the rank
  with the fewest tokens so far), not by row count;
- each rank cuts its rows into micro-batches (`micro_batch_rows`): `micro_batch_size` rows, or with
  `micro_batch_tokens` as many rows as fit in that many padded tokens. FSDP2 runs collectives in
  every forward and backward, so every rank must run as many micro-batches as the busiest one: the
  others run empty ones (one padding token, no loss token), which add nothing to the gradient.

The loss of a micro-batch is its loss tokens' sum over the loss tokens of the whole mini-batch (all
ranks): gradients summed over ranks and micro-batches are the mini-batch's token-mean gradient, the
same on 1 rank and on N. The FSDP2 engine therefore sums gradients across ranks instead of
averaging them. The global gradient norm is clipped (`clip_grad_norm_` reduces over shards), and
the step's statistics are summed over ranks (`World.all_reduce`).

pi_prox, the policy the importance ratio of every pass after the first is taken against, is the
weights at the start of the step. The first mini-batch's is the first pass's own forward, kept
(detached) as it runs, before any optimizer step; only later mini-batches need a forward of their
own before the first update (`time_recompute_s`). These forwards run in eval mode: pi_prox is the
policy without dropout. A model that drops anything in training (LoRA dropout) recomputes the first
mini-batch's too, since its first pass is noisy. The step's time goes into its statistics, split
(`StepTimes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from rollart.algorithms.grpo import PackedBatch, grpo_loss, staleness
from rollart.algorithms.stats import LossStats
from rollart.training.logprobs import shared_reads

if TYPE_CHECKING:
    from rollart.training.spec import TrainerSpec

CPU = torch.device("cpu")

Logprobs = Callable[[torch.nn.Module, PackedBatch], torch.Tensor]
"""(model, micro-batch) -> the micro-batch's token log-probs [N, T] (see `rollart.training.logprobs`)."""


@dataclasses.dataclass(frozen=True)
class World:
    """Which rank this is of how many; `group` is the torch.distributed process group (None: the
    default one); `device` is where its collectives' tensors live (NCCL reduces on the GPU)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    device: torch.device = CPU

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` reduced over the ranks in place (sum or max); on one rank, itself."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return tensor


def split_rows(lengths: list[int], parts: int) -> list[list[int]]:
    """Row indices into `parts` lists with near-equal token totals (longest row first, each to the
    list with the fewest tokens so far); each list in increasing order."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        lightest = min(range(parts), key=lambda p: (tokens[p], len(shares[p]), p))
        shares[lightest].append(row)
        tokens[lightest] += lengths[row]
    return [sorted(share) for share in shares]


def micro_batch_rows(lengths: list[int], rows: list[int], *, max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """`rows` cut into micro-batches. `max_tokens` 0: consecutive slices of `max_rows` rows. Otherwise
    rows longest first, each micro-batch as many as fit in `max_tokens` padded tokens (rows x its
    longest row; a row longer than the budget goes alone)."""
    if max_tokens <= 0:
        return [rows[i : i + max_rows] for i in range(0, len(rows), max_rows)]
    out: list[list[int]] = []
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return [sorted(mb) for mb in out]


@dataclasses.dataclass(frozen=True)
class MiniPlan:
    """One mini-batch as one rank runs it: its micro-batches (None: an empty one) and the
    mini-batch's loss tokens over all ranks."""

    micro: list[PackedBatch | None]
    total_tokens: int


def plan_step(batch: PackedBatch, spec: TrainerSpec, world: World) -> list[MiniPlan]:
    """This rank's micro-batches of each mini-batch (see the module docstring)."""
    rows = len(batch)
    per_update = -(-rows // spec.updates_per_batch)
    plans = []
    for start in range(0, rows, per_update):
        mini = list(range(start, min(start + per_update, rows)))
        groups, lengths = read_groups(batch.select(mini), share=spec.share_reads)
        shares = split_rows(lengths, world.size)
        cuts = [
            micro_batch_rows(lengths, share, max_rows=spec.micro_batch_size, max_tokens=spec.micro_batch_tokens)
            for share in shares
        ]
        count = max(len(cut) for cut in cuts)
        mine: list[PackedBatch | None] = [
            batch.select(sorted(mini[row] for group in mb for row in groups[group])) for mb in cuts[world.rank]
        ]
        mine += [None] * (count - len(mine))
        total = int(batch.loss_mask[mini].sum().item())
        plans.append(MiniPlan(mine, total))
    return plans


def read_groups(batch: PackedBatch, *, share: bool) -> tuple[list[list[int]], list[int]]:
    """The rows that go through the decoder as one, and the tokens each group reads: with `share`,
    rows with the same prefix (`shared_reads`), so that they land in one micro-batch on one rank;
    otherwise each row alone, reading all its tokens."""
    if not share:
        return [[row] for row in range(len(batch))], [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
    reads, which = shared_reads(batch.input_ids, batch.attention_mask, batch.loss_mask)
    members: list[list[int]] = [[] for _ in range(len(reads))]
    for row, group in enumerate(which.tolist()):
        members[group].append(row)
    lengths = (reads >= 0).sum(dim=1).tolist()
    order = sorted(range(len(members)), key=lambda group: members[group][0])  # in row order, as unshared
    return [members[group] for group in order], [int(lengths[group]) for group in order]


@dataclasses.dataclass
class StepTimes:
    """Where one rank's step went, in seconds, summed over its passes and micro-batches."""

    recompute_s: float = 0.0
    """No-grad forwards for pi_prox (mini-batches after the first, when the batch is passed over again)."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    """The loss and its backward pass."""
    optimizer_s: float = 0.0
    """Gradient clipping (a reduction across ranks) and the optimizer step."""
    device: torch.device = CPU
    _last: float = dataclasses.field(default_factory=time.perf_counter)

    def lap(self, part: str) -> None:
        """Charge the time since the last lap to `part` (on a GPU, once its queued kernels are done)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        setattr(self, part, getattr(self, part) + now - self._last)
        self._last = now

    def stats(self) -> dict[str, float]:
        return {
            f"time_{name}": getattr(self, name) for name in ("recompute_s", "forward_s", "backward_s", "optimizer_s")
        }


def empty_micro_batch(batch: PackedBatch) -> PackedBatch:
    """One row of one padding token and no loss token: a forward and backward that add nothing."""
    return batch.select([0], width=1)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether `model` drops anything while training (a dropout layer with p > 0)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout) for the block, back in its mode afterwards."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@dataclasses.dataclass
class StepRunner:
    """Runs `train_step` for one rank: a model (plain or FSDP2-sharded), its optimizer and its world."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    spec: TrainerSpec
    _: dataclasses.KW_ONLY
    logprobs: Logprobs
    world: World = World()
    ref_model: torch.nn.Module | None = None
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def _forward(self, model: torch.nn.Module, mb: PackedBatch) -> torch.Tensor:
        with self.autocast():
            return self.logprobs(model, mb)

    def _micro(self, plan: MiniPlan, batch: PackedBatch) -> Iterator[tuple[PackedBatch, bool]]:
        for mb in plan.micro:
            yield (empty_micro_batch(batch), False) if mb is None else (mb, True)

    def train_step(self, batch: PackedBatch, *, version: int) -> dict[str, float]:
        """The step (module docstring); returns its statistics, the same on every rank."""
        started = time.perf_counter()
        spec = self.spec
        plans = plan_step(batch, spec, self.world)
        times = StepTimes(device=self.world.device)
        # pi_prox: the weights at the start of the step, without dropout. Mini-batch 0's comes from its
        # first pass, unless dropout makes that pass's log-probs noisy (LoRA dropout): then it is recomputed too.
        noisy = has_dropout(self.model)
        prox_at_start: dict[int, list[torch.Tensor]] = {0: []}
        with torch.no_grad(), evaluating(self.model):
            for i in range(0 if noisy else 1, len(plans)):
                prox_at_start[i] = [self._forward(self.model, mb) for mb, _ in self._micro(plans[i], batch)]
        times.lap("recompute_s")
        total: LossStats | None = None
        grad_norms = []
        for epoch, (index, plan) in itertools.product(range(spec.epochs), enumerate(plans)):
            self.optimizer.zero_grad(set_to_none=True)
            for k, (mb, real) in enumerate(self._micro(plan, batch)):
                new = self._forward(self.model, mb)
                if epoch == index == 0 and not noisy:
                    prox = new.detach()
                    prox_at_start[0].append(prox)
                else:
                    prox = prox_at_start[index][k]
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = self._forward(self.ref_model, mb)
                times.lap("forward_s")
                loss, stats = grpo_loss(
                    new, prox, mb, spec.grpo, total_tokens=max(plan.total_tokens, 1), ref_logprobs=ref, version=version
                )
                loss.backward()  # type: ignore[no-untyped-call]
                if real:
                    total = stats if total is None else total + stats
                times.lap("backward_s")
            clip = spec.grad_clip if spec.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            self.optimizer.step()
            times.lap("optimizer_s")
        out = self._reduce(total, batch) | times.stats()
        out["grad_norm"] = max(grad_norms)
        out |= staleness(batch.versions, batch.loss_mask, version)
        out["tokens"] = float(batch.loss_tokens)
        out["passes"] = float(spec.epochs)  # the time_* parts are sums over them
        out["train_s"] = time.perf_counter() - started
        return out

    def _reduce(self, total: LossStats | None, batch: PackedBatch) -> dict[str, float]:
        """The step's loss statistics summed over this rank's micro-batches and then over ranks."""
        device = self.world.device
        if total is None:  # this rank got no rows
            total = LossStats.zeros(device)
        sums, peaks = total.split(device, torch.float32)
        self.world.all_reduce(sums)
        self.world.all_reduce(peaks, "max")
        out = LossStats.joined(sums, peaks).means()
        grpo = self.spec.grpo
        out["loss"] = out["policy_loss"] + grpo.kl_coef * out["kl"] + grpo.anchor_coef * out["anchor_kl"]
        return out
