"""Write `arithmetic.jsonl`: small integer arithmetic problems for `env: dataset` (configs/dataset.yaml).

    python examples/datasets/make_arithmetic.py [--out examples/datasets/arithmetic.jsonl] [--rows 1000] [--seed 0]

Each row is `{"question": ..., "answer": ..., "kind": ...}`, ASCII only (the tiny model's tokenizer
reads printable ASCII), with a question no other row asks, in a shuffled order. Three kinds, with
operands from 0 (1 in word problems) to 5: `add` 3% ("What is 3 + 5?"), `sub` 2% ("What is 5 - 3?",
never below 0) and `word` 95%, one sentence of adding or taking away ("Ana has 3 apples and gets 1
more. How many apples does Ana have now?"), whose second number is 1 half the time (`CHANGE`).

Small on purpose, for the default run's ~0.6M-parameter model on two CPU cores: a held-out row asks,
in other words (another name, other things, the other form), a sum some training rows ask too, so
held-out accuracy says whether the model reads the operation and the numbers out of a question it has
not seen (what it learned in 150 steps: benchmarks/results/dataset_run). The direct forms have 36 and
21 questions to give; word problems a few thousand. The same seed writes the same bytes: the file in
the repository is this script's output with the defaults, and
`tests/unit/test_dataset_env.py` checks that it still is.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kim", "Leo", "Mia", "Noor")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "shells", "stamps", "stickers")
MAX_OPERAND = 5
Row = dict[str, str]


def _add(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    return f"What is {a} + {b}?", a + b


def _sub(rng: random.Random) -> tuple[str, int]:
    a, b = sorted((rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)), reverse=True)
    return f"What is {a} - {b}?", a - b


CHANGE = (1, 1, 1, 1, 1, 2, 2, 3, 4, 5)
"""How many a word problem's second number is, drawn from these: 1 half the time, so that reading the first
number alone already pays (the answer is one more or one less half the time), and the second too."""


def _word(rng: random.Random) -> tuple[str, int]:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, MAX_OPERAND), rng.choice(CHANGE)
    if rng.random() < 0.5:
        return f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?", a + b
    a = max(a, b)
    return f"{name} has {a} {things} and gives away {b}. How many {things} does {name} have now?", a - b


Draw = Callable[[random.Random], tuple[str, int]]
KINDS: dict[str, tuple[Draw, float]] = {
    "add": (_add, 0.03),  # 36 questions to draw from
    "sub": (_sub, 0.02),  # 21
    "word": (_word, 0.95),  # 4,480
}


def make_rows(rows: int = 1000, seed: int = 0) -> list[Row]:
    """`rows` problems with distinct questions, each kind its share, drawn from `random.Random(seed)`."""
    rng = random.Random(seed)
    made: list[Row] = []
    asked: set[str] = set()
    for i, (kind, (draw, share)) in enumerate(KINDS.items()):
        want = rows - len(made) if i == len(KINDS) - 1 else round(rows * share)
        for _ in range(100 * want):  # a bound, for a --rows beyond what a kind has to give
            if want == 0:
                break
            question, answer = draw(rng)
            if question not in asked:
                asked.add(question)
                made.append({"question": question, "answer": str(answer), "kind": kind})
                want -= 1
        if want:
            raise SystemExit(f"{kind}: too few distinct questions for {rows} rows")
    rng.shuffle(made)
    return made


def to_jsonl(rows: list[Row]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=HERE / "arithmetic.jsonl")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.write_text(to_jsonl(make_rows(args.rows, args.seed)), encoding="ascii")
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
