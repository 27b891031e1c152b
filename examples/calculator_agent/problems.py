"""Arithmetic word problems for the calculator agent, each made from a seed, with its answer.

    python examples/calculator_agent/problems.py 0 1 2        # the problems of seeds 0, 1 and 2

One problem per episode seed (`ROLLART_EPISODE_SEED`): the same seed gives the same problem on every machine
and every Python (`random.Random(seed)`), so the G episodes of a group solve the same one. The problems are
kept tiny on purpose, for a 10M-parameter model learning from scratch on a CPU: one operation, one sentence
per operation (a fixed template, a few names and things), operands from 1 to `max_number` (the second to
`max_second` where set; the answer of `-` is never below 0, of `/` always whole). Which operations and how
large the numbers are is set by the agent's environment (`CALCULATOR_OPS`, `CALCULATOR_MAX_NUMBER`,
`CALCULATOR_MAX_SECOND`, `ProblemSettings.from_environ`); the warm-up (`warmup.py --ops --max-number
--max-second`) must be given the same.

The conversation the agent opens with (`opening`) is here too, as the warm-up must render the same one.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass

TEMPLATES = {
    "+": "{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
    "-": "{name} has {a} {things} and gives away {b}. How many {things} does {name} have now?",
    "*": "{name} has {a} bags with {b} {things} in each. How many {things} does {name} have?",
    "/": "{name} shares {a} {things} among {b} friends. How many {things} does each friend get?",
}
NAMES = ("Tom", "Ann", "Sam", "Mia")
THINGS = ("apples", "pens", "cards")
SYSTEM_PROMPT = "Use the calculator, then answer with the number."


@dataclass(frozen=True)
class ProblemSettings:
    """Which problems the agent is given (the same for its warm-up)."""

    ops: str = "+"
    """The operations drawn from, each equally often: some of `+ - * /`."""
    max_number: int = 3
    """Operands from 1 to this (the dividend of `/` is the divisor times such a number)."""
    max_second: int | None = None
    """The second operand from 1 to this instead (None: `max_number`). A small one (`max_number` 7,
    `max_second` 2) makes a constant guess pay little (the most common sum is right 1 time in 7) while
    reading the first number alone already pays half the time: a gradient for RL to climb."""

    def __post_init__(self) -> None:
        if not self.ops or any(op not in TEMPLATES for op in self.ops):
            raise ValueError(f"ops: expected some of {''.join(TEMPLATES)}; got {self.ops!r}")
        if self.max_number < 1:
            raise ValueError(f"max_number: expected an integer >= 1; got {self.max_number}")
        if self.max_second is not None and self.max_second < 1:
            raise ValueError(f"max_second: expected an integer >= 1 or none; got {self.max_second}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ProblemSettings:
        """From `CALCULATOR_OPS`, `CALCULATOR_MAX_NUMBER` and `CALCULATOR_MAX_SECOND` (the task's `agent.env`);
        defaults where unset."""
        default = cls()
        second = environ.get("CALCULATOR_MAX_SECOND")
        return cls(
            ops=environ.get("CALCULATOR_OPS", default.ops),
            max_number=int(environ.get("CALCULATOR_MAX_NUMBER", default.max_number)),
            max_second=int(second) if second else default.max_second,
        )


@dataclass(frozen=True)
class Problem:
    question: str
    expression: str
    """What a solver gives the calculator: `3 + 4`."""
    answer: int
    numbers: tuple[int, int]
    """The operands, in the order the question says them."""


def make_problem(seed: int, settings: ProblemSettings = ProblemSettings()) -> Problem:
    """The problem of `seed`."""
    rng = random.Random(seed)
    op = rng.choice(settings.ops)
    a, b = rng.randint(1, settings.max_number), rng.randint(1, settings.max_second or settings.max_number)
    if op == "-":
        a, b = max(a, b), min(a, b)
    elif op == "/":
        a = a * b
    answer = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    question = TEMPLATES[op].format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b)
    return Problem(question, f"{a} {op} {b}", answer, (a, b))


def opening(problem: Problem) -> list[dict[str, str]]:
    """The messages the agent's first call sends: the system prompt and the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.question}]


if __name__ == "__main__":
    for seed in sys.argv[1:] or ["0"]:
        p = make_problem(int(seed))
        print(f"{seed}: {p.question}  [{p.expression} = {p.answer}]")
