"""Which groups of a batch GRPO trains on: the has-signal rule and the anchor groups, over plain rewards.

A group whose rewards are all equal has a group-relative advantage of exactly zero everywhere
(`grpo.group_advantages` masks it so): it carries no signal. The SampleBuffer uses `has_signal` to
count only such groups toward a batch (`rollout.dynamic_sampling`, DAPO's dynamic sampling); the
learner uses `select_groups` to leave the others out of the gradient, where their tokens would only
dilute the token mean. With the anchor on (`grpo.anchor_coef > 0`) up to `grpo.anchor_groups` of
them, drawn at random, stay in: the anchor term holds their behaviour in place.

Pure code over lists of rewards: no torch, no wire types, so the buffer and the learner share one
rule without either importing the other's world.

    >>> select_groups([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]], anchors=0).trained
    [1]
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ, so that its group-relative advantages are not all zero."""
    return len(set(rewards)) > 1


def groups_with_signal(rewards: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the groups (each a list of its trajectories' rewards) that carry signal."""
    return [i for i, group in enumerate(rewards) if has_signal(group)]


@dataclasses.dataclass(frozen=True)
class Selection:
    """The groups of a batch to train on, by index into the batch."""

    signal: list[int]
    """Groups with signal, in batch order."""
    trained: list[int]
    """Groups with signal plus the anchor groups drawn, in batch order (empty: no optimizer step)."""
    without_signal: int
    """How many groups of the batch have none."""


def select_groups(rewards: Sequence[Sequence[float]], *, anchors: int, rng: random.Random | None = None) -> Selection:
    """The groups to train on: those with signal and, when there are any, up to `anchors` of the
    others drawn at random (`rng`, else the `random` module's generator, which checkpoints save).
    A batch with no signal at all trains on nothing, anchors included: AdamW's momentum would still
    move the weights on a zero policy gradient."""
    signal = groups_with_signal(rewards)
    trained = list(signal)
    if signal and anchors > 0:
        quiet = [i for i in range(len(rewards)) if i not in signal]
        sample = random.sample if rng is None else rng.sample
        trained = sorted(signal + sample(quiet, min(anchors, len(quiet))))
    return Selection(signal=signal, trained=trained, without_signal=len(rewards) - len(signal))
