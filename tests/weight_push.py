"""One weight push the way a run makes it (`rollart.testkit.push`), returning the receiver's counts."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rollart.testkit.push import push_once
from rollart.weights.receiver import ApplyWeights, ReceiverStats


async def push_over_tcp(
    apply: ApplyWeights,
    version: int,
    weights: Mapping[str, torch.Tensor],
    *,
    holding: int = 0,
    shared: bool = False,
    timeout: float = 60,
) -> ReceiverStats:
    """Publish `weights` as `version` to a receiver holding `holding` whose `apply` is given (receiving into shared
    memory when `shared`); return the receiver's stats once the publisher has the acknowledgement (after `apply`
    returned)."""
    try:
        return (await push_once(apply, version, weights, holding=holding, shared=shared, timeout=timeout)).stats
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None
