"""The problems of the `code` task: small functions over integers and lists, with their answers.

Each template draws its details (a divisor) from the episode's RNG and returns a `Problem`: the
statement the model reads, the call's signature, how to draw one test case's arguments, and the
reference answer for any arguments (computed by the env, never shown to the program).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One episode's problem: what to write, how to call it, and the right answer for any arguments."""

    statement: str
    """What `solve` must return, after "Write a Python function `solve(...)` that ..."."""
    signature: str
    make_args: Callable[[random.Random], list[Any]]
    answer: Callable[..., Any]


def _ints(rng: random.Random, low: int = 0, high: int = 8) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(low, high))]


def _sum_even(rng: random.Random) -> Problem:
    return Problem(
        "returns the sum of the even numbers in the list of integers `xs`",
        "solve(xs)",
        lambda r: [_ints(r)],
        lambda xs: sum(x for x in xs if x % 2 == 0),
    )


def _count_multiples(rng: random.Random) -> Problem:
    m = rng.randint(2, 5)
    return Problem(
        f"returns how many numbers in the list of integers `xs` are multiples of {m}",
        "solve(xs)",
        lambda r: [_ints(r)],
        lambda xs: sum(1 for x in xs if x % m == 0),
    )


def _dedupe(rng: random.Random) -> Problem:
    return Problem(
        "returns the list `xs` without repeated values, keeping the first occurrence of each, in order",
        "solve(xs)",
        lambda r: [[r.randint(0, 5) for _ in range(r.randint(0, 10))]],
        lambda xs: list(dict.fromkeys(xs)),
    )


def _running_sums(rng: random.Random) -> Problem:
    return Problem(
        "returns the running sums of the list `xs`: item i is xs[0] + ... + xs[i]",
        "solve(xs)",
        lambda r: [_ints(r)],
        lambda xs: [sum(xs[: i + 1]) for i in range(len(xs))],
    )


def _rotate(rng: random.Random) -> Problem:
    return Problem(
        "returns the list `xs` rotated left by `k` places (`k` >= 0, possibly more than len(xs))",
        "solve(xs, k)",
        lambda r: [_ints(r), r.randint(0, 12)],
        lambda xs, k: xs[k % len(xs) :] + xs[: k % len(xs)] if xs else [],
    )


def _digit_sum(rng: random.Random) -> Problem:
    return Problem(
        "returns the sum of the decimal digits of the integer `n` (of its absolute value)",
        "solve(n)",
        lambda r: [r.randint(-(10**6), 10**6)],
        lambda n: sum(int(d) for d in str(abs(n))),
    )


def _second_largest(rng: random.Random) -> Problem:
    return Problem(
        "returns the second largest distinct value in the list of integers `xs`, or None if there is none",
        "solve(xs)",
        lambda r: [_ints(r, 0, 6)],
        lambda xs: sorted(set(xs))[-2] if len(set(xs)) >= 2 else None,
    )


PROBLEMS: tuple[Callable[[random.Random], Problem], ...] = (
    _sum_even,
    _count_multiples,
    _dedupe,
    _running_sums,
    _rotate,
    _digit_sum,
    _second_largest,
)
"""The templates, drawn uniformly per episode."""
