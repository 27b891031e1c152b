"""Packed batches the training tests and benchmarks share: a fixed synthetic one, and random ones of any shape."""

from __future__ import annotations

import dataclasses
import random

from rollart.algorithms.grpo import PackedBatch, pack_batch


@dataclasses.dataclass(frozen=True)
class Seq:
    """A trajectory as `pack_batch` reads it."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    segments: list[int] = dataclasses.field(default_factory=list)
    generators: list[str] = dataclasses.field(default_factory=list)
    """Who served each generation call (`pack_batch(generators=)` names them per token)."""


def synthetic_batch(temperature: float = 1.0) -> PackedBatch:
    """Four sequences of different lengths from fixed ids (the tiny vocabulary has 101 tokens).

    Behaviour log-probs sit around log(1/101) = -4.6, above and below it, so the importance
    weights differ per token (one is truncated at tis_cap); the second sequence has a
    multi-turn observation gap (mask 0 inside the response); advantages do not sum to zero, so
    the losses stay away from 0 and a relative tolerance means something.
    """
    seqs = [
        Seq([5, 70, 71, 72, 73, 6], [40, 41, 42, 3], [1, 1, 1, 1], [-4.0, -5.0, -4.6, -4.4], [3, 3, 3, 3]),
        Seq(
            [5, 80, 81, 6],
            [50, 51, 3, 9, 60, 61, 6, 52, 53, 3],
            [1, 1, 1, 0, 0, 0, 0, 1, 1, 1],
            [-4.2, -4.9, -4.5, 0.0, 0.0, 0.0, 0.0, -6.0, -4.1, -4.7],
            [2, 2, 2, -1, -1, -1, -1, 3, 3, 3],
        ),
        Seq([5, 90, 6], [44, 45], [1, 1], [-4.8, -4.3], [1, 1]),
        Seq(
            [5, 70, 90, 71, 91, 72, 6], [30, 31, 32, 33, 34, 3], [1] * 6, [-4.6, -4.5, -4.7, -3.9, -5.2, -4.6], [3] * 6
        ),
    ]
    return pack_batch(seqs, [1.0, -0.5, 0.75, -1.25], pad_id=0, temperature=temperature)


def random_batch(
    seed: int, *, rows: int, vocab: int = 101, max_prompt: int = 12, max_response: int = 24
) -> PackedBatch:
    """`rows` sequences of random lengths and tokens (ids 5 to vocab - 1), each with an observation
    gap in some of them, behaviour log-probs around -4.6 and advantages in [-1, 1]."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(rows):
        p, r = rng.randint(2, max_prompt), rng.randint(2, max_response)
        mask = [1] * r
        if r > 6 and rng.random() < 0.5:
            gap = rng.randint(1, r - 4)
            mask[gap : gap + 2] = [0, 0]
        seqs.append(
            Seq(
                [rng.randint(5, vocab - 1) for _ in range(p)],
                [rng.randint(5, vocab - 1) for _ in range(r)],
                mask,
                [rng.uniform(-5.5, -3.8) if m else 0.0 for m in mask],
                [rng.randint(1, 3) if m else -1 for m in mask],
            )
        )
    return pack_batch(seqs, [rng.uniform(-1, 1) for _ in seqs], pad_id=0)


def repeated_batch() -> PackedBatch:
    """Rows that read the same prefix, as a batch of one-token turns has them: 3 prompts, each answered
    several times with one token (the same answer or another), two identical longer answers, two
    answers that part before their last token, and a row with no loss token."""
    rng = random.Random(7)
    seqs = []
    for prompt in ([5, 20, 21, 22, 6], [5, 20, 23, 6], [5, 30, 31, 32, 33, 34, 6]):
        for answer in (40, 41, 40, 42, 40):
            seqs.append(Seq(prompt, [answer], [1], [rng.uniform(-5.5, -3.8)], [2]))
    long = [5, 60, 61, 6]
    for reply in ([44, 45, 46, 3], [44, 45, 46, 3], [44, 47, 46, 3], [44, 45, 46, 9]):
        seqs.append(Seq(long, reply, [1] * 4, [rng.uniform(-5.5, -3.8) for _ in reply], [3] * 4))
    seqs.append(Seq([5, 20, 21, 22, 6], [40, 8, 9], [0, 0, 0], [0.0] * 3, [-1] * 3))
    return pack_batch(seqs, [rng.uniform(-1, 1) for _ in seqs], pad_id=0)


def grouped_batch() -> PackedBatch:
    """A group's answers to one prompt, as the `repeat` task has them: 3 prompts of 9-12 tokens, each
    answered 4 times with 3-4 different tokens (one answer masked in its middle, one of them twice)."""
    rng = random.Random(11)
    seqs = []
    for prompt_length in (9, 12, 10):
        prompt = [5] + [rng.randint(20, 39) for _ in range(prompt_length - 2)] + [6]
        answers = [[rng.randint(40, 49) for _ in range(3 + i % 2)] for i in range(3)]
        for answer in [*answers, answers[0]]:
            mask = [1, 0, 1, 1][: len(answer)] if answer is answers[1] else [1] * len(answer)
            logprobs = [rng.uniform(-5.5, -3.8) if m else 0.0 for m in mask]
            seqs.append(Seq(prompt, answer, mask, logprobs, [2 if m else -1 for m in mask]))
    return pack_batch(seqs, [rng.uniform(-1, 1) for _ in seqs], pad_id=0)
