"""GRPO for asynchronous rollouts: group advantages and the decoupled PPO loss with truncated IS.

Advantages are GRPO's: each trajectory's reward minus its group's mean, divided by the group's
population std (what GRPO implementations use; `normalize_std=False` gives Dr. GRPO), broadcast on
the trajectory's generated tokens.

The loss is decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL
uses it for asynchronous RL). It involves three policies:

- mu, the behaviour policy: the generator's weights that sampled each token, possibly several
  versions old; its log-probs come with every trajectory;
- pi_prox, the proximal policy: the trainer's weights at the start of this training step (detached);
- pi_theta, the weights being optimized.

Per loss token, with A the token's advantage:

    w         = min(exp(prox - mu), tis_cap)                        (detached)
    r         = exp(new - prox)
    surrogate = min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps_high) * A)
    loss_t    = -w * surrogate + kl_coef * k3(ref) + anchor_coef * k3(prox),
                k3(x) = min(exp(d) - d - 1, K3_MAX),  d = clamp(x - new, +-K3_LOG_RATIO_MAX)

w corrects for staleness (the data came from mu, not pi_prox); truncating it at tis_cap bounds its
variance when mu gave a token far less probability than pi_prox does. The trust region is taken
around pi_prox, the recent weights, not around the stale mu: clipping pi_theta / mu instead, stale
data can sit outside the clip range before any update and its tokens then get no gradient, while
others may move as far as the staleness allows. When mu == pi_prox (fully on-policy) w = 1 and this
is exactly PPO-clip. k3 is Schulman's non-negative, low-variance estimator of KL(pi_theta || pi_ref),
bounded as verl's `low_var_kl` is: it grows as exp(x - new) where pi_theta gives a token far less
probability than pi_ref, and such tokens made a batch's mean KL 541 and its gradient norm 1354 after one
step (benchmarks/results/calculator_agent/README.md); a token past the bound gets no KL gradient.
The anchor is the same estimator against pi_prox on every generated token, zero-advantage ones
included: a task whose groups are all solved gets no policy gradient, and without it nothing holds
its behaviour while other tasks' updates move the shared weights.

Aggregation is a token mean over the whole batch: `grpo_loss` sums loss_t over one micro-batch's
loss tokens and divides by `total_tokens`, the loss tokens of the whole batch. Summing the
micro-batches' gradients therefore gives the whole batch's gradient, whatever the split. The
trainer leaves out groups whose rewards are all equal (zero advantage, no signal) before packing
(`rollart.algorithms.selection`), so the mean is over tokens that carry signal.

A training step, in outline:

    batch = pack_batch(trajectories, advantages, pad_id=pad)
    prox = [token_logprobs(model(mb.input_ids, attention_mask=mb.attention_mask).logits, mb.input_ids)
            for mb in batch.micro_batches(k)]                            # under torch.no_grad()
    for mb, prox_mb in zip(batch.micro_batches(k), prox):
        new = token_logprobs(model(...).logits, mb.input_ids)
        loss, stats = grpo_loss(new, prox_mb, mb, cfg, total_tokens=batch.loss_tokens)
        loss.backward()
    optimizer.step()
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from rollart.algorithms.config import GRPOConfig
from rollart.algorithms.stats import SOURCES, LossStats


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, G] -> advantages [groups, G]: (r - group mean) / (group population std + eps).

    The std is the population one (correction 0), as in GRPO implementations. A group whose rewards
    are all equal gets exactly 0 everywhere: it has nothing to prefer.
    """
    if rewards.dim() != 2:
        raise ValueError(f"expected rewards of shape [groups, G]; got {tuple(rewards.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (rewards.std(dim=1, keepdim=True, correction=0) + eps)
    # The mean of equal floats need not equal them exactly; the rounding error over a near-zero std
    # would give a spurious advantage.
    same = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return centred.masked_fill(same, 0.0)


def ragged_group_advantages(
    rewards: Sequence[Sequence[float]], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[list[float]]:
    """`group_advantages` of groups of any sizes (a group cut at its deadline keeps fewer than G): each
    group's against its own mean and std; groups of one size are computed together."""
    sizes: dict[int, list[int]] = {}
    for i, group in enumerate(rewards):
        sizes.setdefault(len(group), []).append(i)
    out: list[list[float]] = [[] for _ in rewards]
    for members in sizes.values():
        computed = group_advantages(
            torch.tensor([list(rewards[i]) for i in members], dtype=torch.float32),
            normalize_std=normalize_std,
            eps=eps,
        )
        for i, row in zip(members, computed.tolist(), strict=True):
            out[i] = row
    return out


class SequenceLike(Protocol):
    """A finished trajectory as `pack_batch` reads it (protocol.messages.Trajectory is one)."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def response_ids(self) -> Sequence[int]: ...
    @property
    def response_mask(self) -> Sequence[int]:
        """Per response token: 1 if the policy generated it, 0 if the environment inserted it."""

    @property
    def logprobs(self) -> Sequence[float]:
        """Per response token: the behaviour policy's log-prob of it (read on generated tokens only)."""

    @property
    def versions(self) -> Sequence[int]:
        """Per response token: the weight version that generated it (read on generated tokens only)."""

    @property
    def segments(self) -> Sequence[int]:
        """Offsets into the response where a turn's own prompt starts, increasing; empty: one row."""


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Rows as right-padded tensors, all [N, T]: a row is a trajectory's prompt + response, or one
    segment of it; position t refers to token t of the row."""

    input_ids: torch.Tensor
    """Prompt and response tokens, padded with pad_id (long)."""
    attention_mask: torch.Tensor
    """1 on real tokens (long)."""
    loss_mask: torch.Tensor
    """1 exactly on generated tokens; 0 on prompt, observations and padding (float)."""
    behaviour_logprobs: torch.Tensor
    """The generator's log-prob of each generated token, 0 elsewhere (float)."""
    advantages: torch.Tensor
    """The sequence's advantage on its loss tokens, 0 elsewhere (float)."""
    versions: torch.Tensor
    """The weight version that generated each token, -1 elsewhere (long)."""
    sources: torch.Tensor
    """The index of the generator that sampled each token in the names `pack_batch` was given (-1 elsewhere, and where
    it is not known): the mismatch monitor's per-generator figures (long)."""
    temperature: torch.Tensor
    """The temperature each token was sampled at (float, `run.rollout.sampling.temperature`): the trainer scores a
    token under log_softmax(logits / temperature), the distribution the generator drew it from."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        """Loss tokens in the whole batch: the `total_tokens` of `grpo_loss`."""
        return int(self.loss_mask.sum().item())

    def micro_batches(self, size: int) -> Iterator[PackedBatch]:
        """Slices of `size` rows, each cut to its own longest sequence.

        The cut depends on the rows alone, so equal calls give equal shapes: compute the prox and ref
        log-probs of a micro-batch with the same `size` as its new log-probs.
        """
        if size < 1:
            raise ValueError(f"expected a micro-batch size >= 1; got {size}")
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    def select(self, rows: Sequence[int], *, width: int | None = None) -> PackedBatch:
        """These rows, cut to their longest sequence (or to `width` positions)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        if width is None:
            width = int(self.attention_mask[index].sum(dim=1).max().item())
        return PackedBatch(**{f.name: getattr(self, f.name)[index, :width] for f in dataclasses.fields(self)})

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def pack_batch(
    sequences: Sequence[SequenceLike],
    advantages: Sequence[float],
    *,
    pad_id: int,
    temperature: float = 1.0,
    generators: Sequence[str] = (),
) -> PackedBatch:
    """Pack trajectories and their advantages into right-padded tensors (see `PackedBatch`), sampled at
    `temperature`; `generators`: the names `PackedBatch.sources` indexes (a trajectory's `generators`, one per
    generation call, are matched to its runs of generated tokens; where the counts differ, its sources are -1).

    A trajectory with `segments` (each turn its own prompt, `context: last`) gives one row per
    segment, every row with the trajectory's advantage; otherwise one row per trajectory.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to train on sampled tokens; got {temperature}")
    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences but {len(advantages)} advantages")
    if not sequences:
        raise ValueError("no sequences to pack")
    rows: list[_Row] = []
    index = {name: i for i, name in enumerate(generators)}
    for i, (seq, advantage) in enumerate(zip(sequences, advantages, strict=True)):
        rows += _rows(i, seq, advantage, index)
    n, width = len(rows), max(len(ids) for ids, *_ in rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width))
    behaviour = torch.zeros((n, width))
    adv = torch.zeros((n, width))
    versions = torch.full((n, width), -1, dtype=torch.long)
    sources = torch.full((n, width), -1, dtype=torch.long)
    for i, (ids, row_mask, logprobs, row_versions, row_sources, advantage) in enumerate(rows):
        t = len(ids)
        input_ids[i, :t] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :t] = 1
        mask = torch.tensor(row_mask, dtype=torch.float32)
        loss_mask[i, :t] = mask
        behaviour[i, :t] = torch.tensor(logprobs, dtype=torch.float32) * mask
        adv[i, :t] = advantage * mask
        versions[i, :t] = torch.where(mask > 0, torch.tensor(row_versions, dtype=torch.long), -1)
        sources[i, :t] = torch.tensor(row_sources, dtype=torch.long)
    temperatures = torch.full((n, width), float(temperature))
    return PackedBatch(input_ids, attention_mask, loss_mask, behaviour, adv, versions, sources, temperatures)


_Row = tuple[list[int], list[int], list[float], list[int], list[int], float]
"""(ids, loss mask, log-probs, versions, sources, advantage) of one row."""


def _token_sources(mask: Sequence[int], generators: Sequence[str], index: dict[str, int]) -> list[int]:
    """Each response token's generator, by its index: the k-th run of generated tokens is the k-th generation call
    (`generators[k]`); -1 elsewhere, and everywhere when the runs and the calls do not match one to one."""
    out = [-1] * len(mask)
    runs = [t for t, m in enumerate(mask) if m and (t == 0 or not mask[t - 1])]
    if len(runs) != len(generators) or not all(name in index for name in generators):
        return out
    run = -1
    for t, m in enumerate(mask):
        if m:
            run += t == 0 or not mask[t - 1]
            out[t] = index[generators[run]]
    return out


def _rows(i: int, seq: SequenceLike, advantage: float, index: dict[str, int]) -> list[_Row]:
    """Sequence `i` checked and cut at its segments: (ids, loss mask, log-probs, versions, sources, advantage)
    per row, over prompt + response positions."""
    p, r = len(seq.prompt_ids), len(seq.response_ids)
    lengths = {name: len(getattr(seq, name)) for name in ("response_mask", "logprobs", "versions")}
    if any(length != r for length in lengths.values()):
        raise ValueError(f"sequence {i}: response_ids has {r} tokens but {lengths}; expected all equal")
    if p == 0:
        raise ValueError(f"sequence {i}: empty prompt; the first token has no log-prob")
    if not set(seq.response_mask) <= {0, 1}:
        raise ValueError(f"sequence {i}: response_mask holds values other than 0 and 1")
    cuts = list(seq.segments)
    if cuts != sorted(set(cuts)) or any(not 0 < cut < r for cut in cuts):
        raise ValueError(f"sequence {i}: segments {cuts} are not increasing offsets inside its {r} response tokens")
    if any(seq.response_mask[cut] for cut in cuts):
        raise ValueError(f"sequence {i}: a segment starts on a generated token; it must start with a prompt")
    ids = [*seq.prompt_ids, *seq.response_ids]
    mask = [0] * p + list(seq.response_mask)
    logprobs = [0.0] * p + list(seq.logprobs)
    versions = [-1] * p + list(seq.versions)
    sources = [-1] * p + _token_sources(seq.response_mask, getattr(seq, "generators", ()), index)
    bounds = [0, *(p + cut for cut in cuts), p + r]
    return [
        (ids[a:b], mask[a:b], logprobs[a:b], versions[a:b], sources[a:b], advantage)
        for a, b in itertools.pairwise(bounds)
    ]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits [N, T, V] of a causal LM on input_ids [N, T] -> [N, T] float32 log-prob of token t
    given the tokens before it; 0 at t = 0."""
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    # Row by row: the float32 log-softmax of all [N, T, V] at once would be the step's largest tensor.
    # Under no_grad (prox and ref log-probs) only one row's copy lives at a time.
    rows = [
        torch.log_softmax(logits[i, :-1].float(), dim=-1).gather(-1, input_ids[i, 1:, None]).squeeze(-1)
        for i in range(logits.shape[0])
    ]
    if not rows:
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    return torch.nn.functional.pad(torch.stack(rows), (1, 0))


K3_LOG_RATIO_MAX = 20.0
"""k3's log-ratio is clamped to this either way (verl's `low_var_kl`'s bounds)."""
K3_MAX = 10.0
"""k3 is capped here (module docstring)."""


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi_theta || pi_x) per token from log(pi_x / pi_theta), bounded."""
    d = log_ratio.clamp(-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX)
    return (torch.exp(d) - d - 1).clamp(max=K3_MAX)


def grpo_loss(
    new_logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    batch: PackedBatch,
    cfg: GRPOConfig,
    *,
    total_tokens: int,
    ref_logprobs: torch.Tensor | None = None,
    version: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The decoupled PPO objective with a truncated behaviour importance weight, on one micro-batch.

    All log-prob tensors are [N, T] like `batch`'s (see `token_logprobs`); only `new_logprobs` gets a
    gradient. The loss is the micro-batch's share of the whole batch's token mean: its loss tokens'
    sum divided by `total_tokens`. `version`: the weights the step starts from, whose tokens the mismatch
    statistics read (`LossStats.fresh_tokens`; None: none).
    """
    for name, tensor in (("new_logprobs", new_logprobs), ("prox_logprobs", prox_logprobs), ("ref", ref_logprobs)):
        if tensor is not None and tensor.shape != batch.loss_mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; the batch is {tuple(batch.loss_mask.shape)}")
    if total_tokens < 1:
        raise ValueError(f"expected total_tokens >= 1; got {total_tokens}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    dtype = new_logprobs.dtype
    mask = batch.loss_mask.to(dtype)
    on = mask > 0
    zero = torch.zeros_like(mask)
    prox = prox_logprobs.detach().to(dtype)
    # Log-ratios are zeroed off the loss tokens before exp: there they mean nothing and could
    # overflow, and an inf would turn into NaN in the gradient even through torch.where.
    behaviour_ratio = torch.exp(torch.where(on, prox - batch.behaviour_logprobs.to(dtype), zero))
    weight = behaviour_ratio.clamp(max=cfg.tis_cap)
    ratio = torch.exp(torch.where(on, new_logprobs - prox, zero))
    advantages = batch.advantages.to(dtype)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_high) * advantages
    policy = -weight * torch.minimum(unclipped, clipped) * mask
    per_token = policy
    kl = zero
    if ref_logprobs is not None:
        kl = k3(torch.where(on, ref_logprobs.detach().to(dtype) - new_logprobs, zero)) * mask
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    anchor = zero
    if cfg.anchor_coef > 0:
        anchor = k3(torch.where(on, prox - new_logprobs, zero)) * mask
        per_token = per_token + cfg.anchor_coef * anchor
    loss = per_token.sum() / total_tokens
    with torch.no_grad():
        stats = LossStats(
            tokens=mask.sum(),
            policy_loss=policy.sum(),
            kl=kl.sum(),
            importance_ratio=(behaviour_ratio * mask).sum(),
            importance_ratio_max=torch.where(on, behaviour_ratio, zero).max(),
            truncated=((behaviour_ratio > cfg.tis_cap) & on).sum().to(dtype),
            clipped=((clipped < unclipped) & on).sum().to(dtype),
            anchor=anchor.sum(),
            **_mismatch(prox, batch, on, version),
        )
    return loss, stats


def _mismatch(prox: torch.Tensor, batch: PackedBatch, on: torch.Tensor, version: int | None) -> dict[str, torch.Tensor]:
    """`LossStats`' fresh_* sums: pi_prox against mu on the loss tokens the step's own weights generated."""
    fresh = on & (batch.versions.to(on.device) == (-2 if version is None else version))
    d = torch.where(fresh, prox - batch.behaviour_logprobs.to(prox.dtype), torch.zeros_like(prox))
    ratio = torch.exp(d)
    known = fresh & (batch.sources.to(on.device) >= 0) & (batch.sources.to(on.device) < SOURCES)
    where = batch.sources.to(on.device)[known]
    per_source = torch.zeros(SOURCES, dtype=prox.dtype, device=prox.device)
    return {
        "source_tokens": per_source.index_add(0, where, torch.ones_like(where, dtype=prox.dtype)),
        "source_kl": per_source.index_add(0, where, k3(d)[known]),
        "fresh_tokens": fresh.sum().to(prox.dtype),
        "fresh_kl": torch.where(fresh, k3(d), torch.zeros_like(d)).sum().clamp(min=0),  # not -1e-9 from rounding
        "fresh_ratio": torch.where(fresh, ratio, torch.zeros_like(d)).sum(),
        "fresh_ratio_max": torch.where(fresh, ratio, torch.zeros_like(d)).max(),
    }


def staleness(versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """How many versions behind `trainer_version` the loss tokens were generated: mean and max."""
    behind = (trainer_version - versions[mask > 0]).float()
    if behind.numel() == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": behind.mean().item(), "staleness_max": behind.max().item()}
