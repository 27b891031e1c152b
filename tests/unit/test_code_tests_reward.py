"""The `code_tests` reward: a reply's program run against a dataset row's tests, in a child process.

Real child processes, no mocks: right, half-right, broken and endless programs, a reply without the
function, references that are not tests, and a coding dataset read through `env: dataset` whose
tests field is a JSON list, scored end to end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from rollart.envs import make_env
from rollart.rewards import RewardError, ScoreInput, ScoreOutput, code_tests, registered_rewards
from rollart.rewards.functions import CODE_TESTS_TIMEOUT_S
from rollart.tasks.dataset import answer_text

DOUBLE_TESTS = [{"args": [1], "expected": 2}, {"args": [3], "expected": 6}]
"""Tests of `solve(n) == 2 * n`."""


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}\n```\nDone."


def score(program: str, tests: Any = DOUBLE_TESTS, *, raw: str | None = None) -> ScoreOutput:
    answer = json.dumps(tests) if raw is None else raw
    return code_tests(ScoreInput(task="code-set", prompt="Write solve(n).", response=fenced(program), answer=answer))


def test_code_tests_is_registered() -> None:
    assert "code_tests" in registered_rewards()


def test_code_tests_right_program_scores_one() -> None:
    out = score("def solve(n):\n    return 2 * n")
    assert out.reward == 1.0
    assert out.details == {"passed": 2, "tests": 2, "timed_out": False, "format_error": False, "first_failure": ""}


def test_code_tests_half_right_program_scores_half_and_names_the_first_failure() -> None:
    out = score("def solve(n):\n    return 2 if n == 1 else n")
    assert out.reward == 0.5
    assert (out.details["passed"], out.details["tests"], out.details["format_error"]) == (1, 2, False)
    assert out.details["first_failure"] == "First failure: solve(3) returned 3; expected 6."


def test_code_tests_results_must_have_the_expected_type() -> None:
    out = score("def solve(n):\n    return 2.0 * n")
    assert out.reward == 0.0 and "returned 2.0; expected 2" in out.details["first_failure"]


def test_code_tests_syntax_error_scores_zero() -> None:
    out = score("def solve(n)\n    return 2 * n")
    assert out.reward == 0.0 and out.details["passed"] == 0
    assert out.details["first_failure"].startswith("The program failed to load: SyntaxError")


def test_code_tests_infinite_loop_times_out() -> None:
    started = time.monotonic()
    out = score("def solve(n):\n    while True:\n        pass")
    assert time.monotonic() - started < CODE_TESTS_TIMEOUT_S + 3
    assert out.reward == 0.0 and out.details["timed_out"] is True
    assert out.details["first_failure"].startswith(f"The program did not finish within {CODE_TESTS_TIMEOUT_S:g} s.")


def test_code_tests_reply_without_solve_is_a_format_error() -> None:
    out = score("def double(n):\n    return 2 * n")
    assert out.reward == 0.0
    assert out.details["format_error"] is True and out.details["passed"] == 0


def test_code_tests_long_output_is_clipped_in_the_failure() -> None:
    out = score("def solve(n):\n    print('x' * 100_000)\n    return n")
    assert out.reward == 0.0
    assert out.details["first_failure"].startswith("First failure: solve(1) returned 1; expected 2.")
    assert len(out.details["first_failure"]) <= 1000


def test_code_tests_calls_the_function_the_reference_names() -> None:
    tests = {"function": "add", "tests": [{"args": [1, 2], "expected": 3}, {"args": [[1], [2]], "expected": [1, 2]}]}
    assert score("def add(a, b):\n    return a + b", tests).reward == 1.0
    wrong = score("def add(a, b):\n    return a", tests)
    assert wrong.reward == 0.0 and wrong.details["first_failure"].startswith("First failure: add(1, 2) returned 1")
    assert score("def solve(a, b):\n    return a + b", tests).details["format_error"] is True
    assert score("def solve(n):\n    return 2 * n", {"tests": DOUBLE_TESTS}).reward == 1.0


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        ("", "gave no reference tests"),
        ("solve(1) == 2", "the reference is not JSON"),
        ("[]", "the tests are an empty list"),
        ('{"args": [1], "expected": 2}', "the reference is an object without 'tests'"),
        ('"[1, 2]"', "the tests are a str"),
        ('[{"args": 1, "expected": 2}]', "test 0 is"),
        ('[{"args": [1], "expected": 2}, {"args": [2]}]', "test 1 is"),
        ('{"function": "not a name", "tests": [{"args": [], "expected": 1}]}', "'function' must be a Python name"),
    ],
)
def test_code_tests_bad_reference_is_a_reward_error_naming_task_and_fault(raw: str, what: str) -> None:
    with pytest.raises(RewardError) as caught:
        score("def solve(n):\n    return 2 * n", raw=raw)
    message = str(caught.value)
    assert message.startswith("code_tests: task 'code-set': ") and what in message
    assert 'expected a JSON list of {"args": [...], "expected": value}' in message


def test_code_tests_scores_a_dataset_whose_tests_field_is_a_json_list(tmp_path: Path) -> None:
    rows = [
        {"question": "Write solve(xs): the sum of xs.", "tests": [{"args": [[1, 2, 3]], "expected": 6}]},
        {"question": "Write solve(xs): xs reversed.", "tests": [{"args": [[1, 2]], "expected": [2, 1]}]},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    programs = {"sum": "def solve(xs):\n    return sum(xs)", "reversed": "def solve(xs):\n    return xs[::-1]"}
    env = make_env("dataset", path=str(path), answer_field="tests", heldout_fraction=0.0)
    for seed in range(2):
        obs, info = env.reset(seed=seed)
        assert obs == rows[info["row"]]["question"]
        (program,) = [program for key, program in programs.items() if key in obs]
        _, _, terminated, _, step_info = env.step(fenced(program))
        assert terminated and json.loads(step_info["answer"]) == rows[info["row"]]["tests"]
        for reply, reward in ((program, 1.0), ("def solve(xs):\n    return 0", 0.0)):
            item = ScoreInput(task="code-set", prompt=obs, response=fenced(reply), answer=step_info["answer"])
            assert code_tests(item).reward == reward


def test_code_tests_dataset_answers_are_strings_numbers_as_text_and_json_otherwise() -> None:
    assert [answer_text(v) for v in (" 12 ", 12, 0.5, True)] == ["12", "12", "0.5", "true"]
    assert answer_text([{"args": [1], "expected": "a"}]) == '[{"args": [1], "expected": "a"}]'
    assert answer_text({"tests": []}) == '{"tests": []}'
