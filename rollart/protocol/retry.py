"""Bounded retries with exponential backoff and jitter: the one way a remote call is tried again.

A session already resends what a dropped connection lost; what it cannot do is ask again when a
peer answered "not now" (`RemoteError`), took too long (`RequestTimeout`) or is still starting.
Callers that want that wrap the call in `retry`:

    reply = await retry(lambda: trainer.request(outcome, timeout=cfg.default_request_timeout_s),
                        what=f"hand-in of {outcome.group_id}", retry_on=(RequestTimeout, RemoteError),
                        backoff=Backoff.for_retries(cfg), deadline_s=cfg.retry_deadline_s)

Each failed try is logged (`retry.again`) with what was tried, the attempt and the error; the
delay before try n+1 is drawn from [bound * (1 - jitter), bound] with bound = min(cap_s,
base_s * 2**n). The retrying stops after `attempts` tries or once `deadline_s` has passed since the
first, with `RetriesExhausted` naming what was tried, how often and the last error.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from rollart.errors import RollartError
from rollart.protocol.config import SessionConfig

log = structlog.get_logger("rollart.protocol.retry")

T = TypeVar("T")

RETRY_JITTER = 0.5
"""The share of each delay drawn at random in `Backoff.for_retries`: peers that failed together do
not retry together, and a retry never comes at once."""


class Uniform(Protocol):
    """Where random delays come from (`random`, or a seeded `random.Random` in tests)."""

    def uniform(self, a: float, b: float) -> float: ...


class RetriesExhausted(RollartError):
    """A retried call failed every try, or its deadline passed; `__cause__` is the last error."""

    def __init__(self, what: str, attempts: int, elapsed_s: float, last: BaseException) -> None:
        super().__init__(f"{what}: gave up after {attempts} tries in {elapsed_s:.1f} s; last error: {last}")
        self.what = what
        self.attempts = attempts


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: attempt n waits between bound * (1 - jitter) and bound,
    bound = min(cap_s, base_s * 2**n). `jitter=1` is full jitter (0 to bound)."""

    base_s: float
    cap_s: float
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if not (0 < self.base_s <= self.cap_s and 0.0 <= self.jitter <= 1.0):
            raise ValueError(f"expected 0 < base_s <= cap_s and 0 <= jitter <= 1; got {self}")

    @classmethod
    def for_retries(cls, cfg: SessionConfig) -> Backoff:
        """The backoff of remote calls retried outside a session (`retry_base_s`, `retry_cap_s`)."""
        return cls(cfg.retry_base_s, cfg.retry_cap_s, RETRY_JITTER)

    def bound(self, attempt: int) -> float:
        """The longest delay after failed try number `attempt` (counted from 0)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt, 64))

    def delay(self, attempt: int, rng: Uniform = random) -> float:
        bound = self.bound(attempt)
        return rng.uniform(bound * (1.0 - self.jitter), bound)


async def retry(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    backoff: Backoff,
    attempts: int | None = None,
    deadline_s: float | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] | None = None,
    rng: Uniform = random,
) -> T:
    """`await fn()`, tried again after each error of a `retry_on` type, at most `attempts` times
    and for at most `deadline_s` seconds (at least one of them must be given); other errors pass
    through at once. `clock` is the event loop's by default. Raises `RetriesExhausted` from the
    last error when the bound is reached."""
    if attempts is None and deadline_s is None:
        raise ValueError(f"retry of {what}: give attempts or deadline_s (an unbounded retry is a hang)")
    if attempts is not None and attempts < 1:
        raise ValueError(f"retry of {what}: attempts must be at least 1; got {attempts}")
    clock = clock or asyncio.get_running_loop().time  # the loop's clock: virtual time in simulations
    start = clock()
    attempt = 0
    while True:
        try:
            return await fn()
        except retry_on as exc:
            attempt += 1
            elapsed = clock() - start
            left = None if deadline_s is None else deadline_s - elapsed
            if (attempts is not None and attempt >= attempts) or (left is not None and left <= 0):
                log.error("retry.gave_up", what=what, attempts=attempt, elapsed_s=round(elapsed, 3), error=str(exc))
                raise RetriesExhausted(what, attempt, elapsed, exc) from exc
            delay = backoff.delay(attempt - 1, rng)
            if left is not None:
                delay = min(delay, left)  # the last try comes at the deadline, not after it
            log.warning("retry.again", what=what, attempt=attempt, delay_s=round(delay, 3), error=str(exc))
            await sleep(delay)
