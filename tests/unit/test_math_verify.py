"""The `math_verify` reward: answers compared as math by Hugging Face's math_verify, in the test's
process, from a worker thread, and in a reward worker process as the reward gateway runs it.

math_verify bounds its work with `signal.alarm`, which only a main thread may set: these tests pin
that behaviour of the library (the reason the function passes no timeout off the main thread) and
that the timeout does stop a runaway comparison inside a reward worker.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart.rewards import RewardError, RewardPool, ScoreInput, get_reward, math_verify
from rollart.rewards.functions import MATH_VERIFY_TIMEOUT_S


def item(response: str, answer: str | None = "12") -> ScoreInput:
    return ScoreInput(task="arithmetic", prompt="p", response=response, answer=answer)


@pytest.mark.parametrize(
    ("answer", "response"),
    [
        ("1/2", "\\boxed{0.5}"),
        ("0.5", "so it is \\boxed{\\frac{1}{2}}"),
        ("\\frac{1}{2}", "\\boxed{1/2}"),
        ("12", "12"),  # no box: math_verify's own extraction over the whole reply
        ("12", "The answer is 12."),
        ("12", "13? No: 12"),
        ("12", "\\boxed{12.0}"),
        ("12", "\\boxed{\\frac{24}{2}}"),
        ("-3", "\\boxed{-3}"),
        ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),
    ],
)
def test_math_verify_takes_equal_answers_in_other_forms(answer: str, response: str) -> None:
    out = math_verify(item(response, answer))
    assert out.reward == 1.0 and out.details["equal"] is True


def test_math_verify_reads_the_last_complete_box() -> None:
    out = math_verify(item("\\boxed{13} no wait: \\boxed{12}"))
    assert (out.reward, out.details) == (1.0, {"boxed": True, "extracted": "12", "equal": True})
    assert math_verify(item("\\boxed{12} then \\boxed{13}")).reward == 0.0
    assert math_verify(item("\\boxed{12} then \\boxed{13")).reward == 1.0  # a box cut off is no answer


@pytest.mark.parametrize(("answer", "response"), [("12", "\\boxed{13}"), ("1/2", "\\boxed{0.25}"), ("12", "13")])
def test_math_verify_scores_wrong_answers_0(answer: str, response: str) -> None:
    out = math_verify(item(response, answer))
    assert out.reward == 0.0 and out.details["equal"] is False


@pytest.mark.parametrize("response", ["", "twelve", "\\boxed{", "\\boxed{}", "@@ ## !!"])
def test_math_verify_scores_a_reply_with_nothing_to_parse_0(response: str) -> None:
    out = math_verify(item(response))
    assert out.reward == 0.0 and out.details["reason"] == "no answer math_verify can parse"


@pytest.mark.parametrize("answer", [None, "", "  "])
def test_math_verify_without_a_reference_is_a_reward_error(answer: str | None) -> None:
    with pytest.raises(RewardError, match=r"math_verify: task 'arithmetic' gave no reference answer"):
        math_verify(item("\\boxed{12}", answer))


def test_math_verify_is_registered_under_its_name() -> None:
    assert get_reward("math_verify") is math_verify


async def test_math_verify_library_refuses_threads_with_its_default_timeouts_and_the_reward_does_not() -> None:
    from math_verify import parse  # type: ignore[import-untyped]

    with pytest.raises(ValueError, match="doesn't support threaded environment"):
        await asyncio.to_thread(parse, "\\boxed{12}")
    out = await asyncio.to_thread(math_verify, item("\\boxed{\\frac{24}{2}}"))
    assert out.reward == 1.0


async def test_math_verify_in_a_reward_worker_process_as_the_gateway_runs_it() -> None:
    async with RewardPool(min_workers=1, max_workers=1) as pool:
        right = await pool.score("math_verify", item("\\boxed{\\frac{24}{2}}"), timeout=60)
        wrong = await pool.score("math_verify", item("\\boxed{13}"), timeout=30)
        nothing = await pool.score("math_verify", item("twelve"), timeout=30)
        assert (right.reward, wrong.reward, nothing.reward) == (1.0, 0.0, 0.0)
        # sympy would compare these for hours; the worker's main thread takes math_verify's alarm,
        # which ends the comparison (unequal), and the same worker serves on.
        started = time.monotonic()
        runaway = await pool.score("math_verify", item("\\boxed{9^{9^{9^{9}}}}", "3"), timeout=30)
        took = time.monotonic() - started
        assert runaway.reward == 0.0 and MATH_VERIFY_TIMEOUT_S <= took < 5 * MATH_VERIFY_TIMEOUT_S
        assert (await pool.score("math_verify", item("12"), timeout=30)).reward == 1.0
        stats = pool.stats()
        assert (stats.crashed, stats.failed, stats.served, stats.cold_starts.count) == (0, 0, 5, 1)
