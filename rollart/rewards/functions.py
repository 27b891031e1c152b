"""The built-in reward functions, registered by `rollart.rewards` on import.

- `exact-answer`: the last complete `\\boxed{...}` of the response (`rollart.envs.answers`, the
  rule the envs read actions by) against the reference answer, with partial credit for matching
  characters (math and reasoning tasks);
- `math_verify`: the response's answer against the reference as mathematics, by Hugging Face's
  `math_verify` (`parse` and `verify`: "1/2", "0.5" and `\\frac{1}{2}` are one answer); 1.0 or 0.0;
- `code_tests`: the reply's program run against the reference's tests (a dataset's coding problems)
  in a child process under limits, by `rollart.envs.programs`; the fraction of tests passed;
- `env-reward`: the environment's own reward, passed through (games such as FrozenLake);
- `tiny-rm`: a tiny, seeded, *untrained* torch network over the response's bytes. It stands in
  for a reward model so that the pool's model-serving path (a torch model built once per worker,
  then reused) runs end to end on a CPU. Its scores are deterministic and in [0, 1], but they
  mean nothing about response quality: swap in a real reward model for training.

Every function raises `RewardError` naming itself and the missing or bad field.
"""

from __future__ import annotations

import json
import math
import threading
from typing import TYPE_CHECKING, Any

from rollart.envs.answers import last_boxed
from rollart.envs.programs import extract_program, judge, run_cases
from rollart.rewards.base import RewardError, ScoreInput, ScoreOutput
from rollart.rewards.worker import in_reward_worker

if TYPE_CHECKING:
    import torch


def exact_answer(item: ScoreInput) -> ScoreOutput:
    """1.0 for the reference answer in the last complete `\\boxed{}`, partial credit for equal
    positions, 0 for no complete box."""
    if item.answer is None or not item.answer.strip():
        raise RewardError(f"exact-answer: task {item.task!r} gave no reference answer (ScoreInput.answer is empty)")
    answer = item.answer.strip()
    boxed = last_boxed(item.response)
    if boxed is None:
        return ScoreOutput(reward=0.0, details={"format_error": True, "reason": "no closed \\boxed{...} in response"})
    extracted = boxed.strip()
    if extracted == answer:
        return ScoreOutput(reward=1.0, details={"extracted": extracted, "exact": True})
    same = sum(a == b for a, b in zip(answer, extracted, strict=False))
    return ScoreOutput(reward=same / max(len(answer), len(extracted)), details={"extracted": extracted, "exact": False})


MATH_VERIFY_TIMEOUT_S = 3
"""Seconds `math_verify` may spend on each parse and each comparison (sympy can run for hours on a
reply such as `9^{9^{9^{9}}}`): past it, that parse finds nothing or that comparison is unequal."""
MATH_VERIFY_SHOWN_CHARS = 200
"""The most of the extracted answer that `details["extracted"]` keeps."""


def math_verify(item: ScoreInput) -> ScoreOutput:
    """1.0 when the response's answer equals the reference as math (`math_verify.verify`), else 0.0.

    The answer is the content of the last complete `\\boxed{...}` (`last_boxed`, as envs and
    `exact-answer` read it); without one, what `math_verify.parse` extracts from the whole response by
    its default rules (LaTeX or a plain expression, the final one: "13? No: 12" gives 12). The
    reference is parsed as if boxed. A response in which nothing parses scores 0.0, as a wrong answer does.

    `math_verify` bounds its work with `SIGALRM` (`signal.alarm`), which works in a process's main
    thread only: elsewhere its `parse` and `verify` raise `ValueError`. A reward worker runs its jobs
    in its main thread, so there each call gets `MATH_VERIFY_TIMEOUT_S`; called from another thread,
    it runs without a limit of its own, bounded only by the caller's deadline.
    """
    if item.answer is None or not item.answer.strip():
        raise RewardError(f"math_verify: task {item.task!r} gave no reference answer (ScoreInput.answer is empty)")
    from math_verify import parse, verify  # type: ignore[import-untyped]  # sympy: ~1 s, once per worker

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{item.answer.strip()}}}", parsing_timeout=timeout)
    boxed = last_boxed(item.response)
    found = parse(item.response if boxed is None else f"\\boxed{{{boxed}}}", parsing_timeout=timeout)
    # What was read, as text: math_verify puts the matched text last; str() of a sympy object can take long.
    text = next((x for x in reversed(found) if isinstance(x, str)), "")[:MATH_VERIFY_SHOWN_CHARS]
    details: dict[str, Any] = {"boxed": boxed is not None, "extracted": text}
    if not found:
        return ScoreOutput(reward=0.0, details={**details, "reason": "no answer math_verify can parse"})
    equal = bool(verify(gold, found, timeout_seconds=timeout))
    return ScoreOutput(reward=1.0 if equal else 0.0, details={**details, "equal": equal})


CODE_TESTS_TIMEOUT_S = 2.0
"""Wall seconds the program may take over all of a reference's tests; then it is killed and scores 0."""
CODE_TESTS_MEMORY_MB = 256
"""The program's address space (RLIMIT_AS)."""
CODE_TESTS_OUTPUT_CHARS = 500
"""The most of the end of the program's stdout and stderr that is kept (and quoted in `first_failure`)."""
CODE_TESTS_FAILURE_CHARS = 1000
"""The most of the first failure's message that `details["first_failure"]` keeps."""
_CODE_TESTS_FORM = 'a JSON list of {"args": [...], "expected": value}, or {"function": "name", "tests": [that list]}'


def code_tests(item: ScoreInput) -> ScoreOutput:
    """The fraction of the reference's tests that the reply's program passes (0.0 to 1.0).

    The reference is JSON: a list of cases `{"args": [...], "expected": value}`, or
    `{"tests": [...], "function": "name"}` to call another function than `solve`. The program is
    the reply's last ```python block (`extract_program`); it runs in a child process
    (`rollart.envs.programs.run_cases`: `python -I`, its own process group, `CODE_TESTS_TIMEOUT_S`,
    `CODE_TESTS_MEMORY_MB`), which calls the function on each case's arguments; a result passes
    when it equals `expected` and has its type (`judge`: 1 is not 1.0). In a reward worker the child
    inherits the worker's sandbox. A program that never names the function scores 0.0 with
    `details["format_error"]`, without being run.
    """
    function, cases, answers = _code_tests_reference(item)
    program = extract_program(item.response)
    details: dict[str, Any] = {"passed": 0, "tests": len(cases), "timed_out": False, "format_error": False}
    if function not in program:
        details["format_error"] = True
        details["first_failure"] = f"No program defining `{function}` found."
        return ScoreOutput(reward=0.0, details=details)
    run = run_cases(
        program,
        cases,
        timeout_s=CODE_TESTS_TIMEOUT_S,
        memory_mb=CODE_TESTS_MEMORY_MB,
        output_chars=CODE_TESTS_OUTPUT_CHARS,
        function=function,
    )
    failure, passed = judge(run, cases, answers, CODE_TESTS_TIMEOUT_S, function=function)
    if len(failure) > CODE_TESTS_FAILURE_CHARS:
        failure = failure[: CODE_TESTS_FAILURE_CHARS - 3] + "..."
    details.update(passed=passed, timed_out=run.timed_out, first_failure=failure)
    return ScoreOutput(reward=passed / len(cases), details=details)


def _code_tests_reference(item: ScoreInput) -> tuple[str, list[list[Any]], list[Any]]:
    """(the function's name, each case's arguments, each case's expected result) from the reference;
    `RewardError` naming the task and what is wrong with it."""

    def bad(what: str) -> RewardError:
        return RewardError(f"code_tests: task {item.task!r}: {what}; expected {_CODE_TESTS_FORM}")

    if item.answer is None or not item.answer.strip():
        raise bad("gave no reference tests (ScoreInput.answer is empty)")
    try:
        reference = json.loads(item.answer)
    except ValueError as exc:
        raise bad(f"the reference is not JSON ({exc}): {item.answer[:80]!r}") from None
    function: Any = "solve"
    if isinstance(reference, dict):
        if "tests" not in reference:
            raise bad(f"the reference is an object without 'tests' (its keys: {', '.join(map(str, reference))})")
        # null: a row whose file names a function in other rows (an Arrow struct gives every row every key).
        function = reference.get("function") or "solve"
        reference = reference["tests"]
    if not isinstance(function, str) or not function.isidentifier():
        raise bad(f"'function' must be a Python name, got {function!r}")
    if not isinstance(reference, list) or not reference:
        raise bad(f"the tests are {'an empty list' if reference == [] else f'a {type(reference).__name__}'}")
    cases, answers = [], []
    for i, case in enumerate(reference):
        if not isinstance(case, dict) or "expected" not in case or not isinstance(case.get("args"), list):
            raise bad(f"test {i} is {json.dumps(case)[:80]}, not an object with a list 'args' and an 'expected'")
        cases.append(case["args"])
        answers.append(case["expected"])
    return function, cases, answers


def env_reward(item: ScoreInput) -> ScoreOutput:
    """The environment's reward, unchanged."""
    if item.env_reward is None:
        raise RewardError(f"env-reward: task {item.task!r} gave no environment reward (ScoreInput.env_reward is None)")
    if not math.isfinite(item.env_reward):
        raise RewardError(f"env-reward: task {item.task!r} gave a non-finite environment reward {item.env_reward!r}")
    return ScoreOutput(reward=float(item.env_reward))


TINY_RM_SEED = 1234
TINY_RM_MAX_BYTES = 4096
_MODELS: dict[str, Any] = {}  # built on first use in each worker process and kept for its lifetime


def _build_tiny_rm() -> torch.nn.Module:
    import torch

    if in_reward_worker():
        # One thread per worker: the pool's parallelism is its processes. In-process callers
        # (tests, a notebook) keep their own setting.
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(TINY_RM_SEED)
    model = torch.nn.Sequential(
        torch.nn.EmbeddingBag(256, 16, mode="mean"),
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )
    with torch.no_grad():
        for p in model.parameters():  # drawn from our own generator: global torch RNG state stays untouched
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def tiny_rm(item: ScoreInput) -> ScoreOutput:
    """A stand-in reward model: sigmoid of a seeded byte-bag network over the response (see module docstring)."""
    import torch

    model = _MODELS.get("tiny-rm")
    if model is None:
        model = _MODELS["tiny-rm"] = _build_tiny_rm()
    # An empty bag has no mean; score the empty response as one NUL byte instead.
    data = item.response.encode("utf-8", errors="replace")[:TINY_RM_MAX_BYTES] or b"\0"
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    with torch.inference_mode():
        logit = model(ids.unsqueeze(0))
    score = float(torch.sigmoid(logit).item())
    return ScoreOutput(reward=score, details={"model": "tiny-rm", "seed": TINY_RM_SEED, "bytes": len(data)})
