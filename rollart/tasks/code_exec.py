"""code: write a small Python function; the reply is a program, run against hidden tests.

Each episode (from its seed) poses one problem over integers and lists ("write `solve(xs)` that
returns the sum of the even numbers in xs"), from a handful of templates (`code_problems`), with
`tests` generated cases; the first observation shows one of them as an example. The action is a
Python program: the last ```python fenced block of the reply (or ``` with no language), else the
whole reply; one that never mentions `solve` gets the format penalty without being run.

The program runs in a child process, `python -I -c HARNESS`, given the program and the cases'
arguments on stdin: no inherited descriptors but its pipes, an environment of PATH alone, its own
empty working directory and process group, `timeout_s` of wall time (then the group is killed),
CPU, address-space, file-size and open-file limits set by the harness before the program is
loaded; its stdout and stderr are kept to their last `output_chars`. The harness reports what
`solve` returned for each case on a pipe of its own; the env compares the outputs with the
answers, which never reach the child, so a program that forges the report gains nothing.

Scoring: the fraction of tests passed. Each step pays the change of that score since the last
program, so an episode's rewards sum to its last program's score; all passed terminates, with
`info["success"]`. Otherwise the observation names the first failing case (its arguments, what
came back or the error, truncated) or that the program did not load, timed out or crashed, and the
model gets another turn, up to `max_turns` (2).

**Where it is safe.** The child is not a sandbox: it runs as the env's process does, and a
program that makes a session of its own outlives the kill of its group. Run this task in env
worker processes (`run.rollout.env_workers.isolation: process`: under `auto` RollArt's built-ins
run in the env-host's threads) with their sandbox (`rollart.workers.sandbox`: another user, a pid
namespace that dies with the worker, no network, a read-only root, a fork limit), which the child
inherits; in the env-host, the model's code would run as the node's user, next to the node.

The runner and the grader are `rollart.envs.programs` (`run_cases`, `judge`), which the `code_tests`
reward (`rollart.rewards.functions`) uses too, for a dataset's coding problems, in the reward workers'
sandbox.
"""

from __future__ import annotations

import random
import sys
from typing import Any

from rollart.envs.base import FORMAT_PENALTY, Env, Info, StepResult, not_running, require, resolve_seed
from rollart.envs.programs import Run, call_text, extract_program, judge, run_cases
from rollart.tasks.code_problems import PROBLEMS, Problem

SYSTEM_PROMPT = (
    "Write the Python function asked for. Answer with the whole program in one ```python code block;"
    " it is run against hidden tests."
)


class CodeEnv(Env):
    """Write `solve`; scored by the fraction of hidden tests it passes; a second turn to fix it."""

    name = "code"
    profile = "decode-heavy"
    max_turns = 2
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        tests: int = 6,
        max_turns: int = 2,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        output_chars: int = 500,
        max_program_chars: int = 20_000,
        python: str = sys.executable,
        format_penalty: float = FORMAT_PENALTY,
    ) -> None:
        require(tests >= 1, self.name, f"tests must be >= 1, got {tests}")
        require(max_turns >= 1, self.name, f"max_turns must be >= 1, got {max_turns}")
        require(timeout_s > 0, self.name, f"timeout_s must be > 0, got {timeout_s}")
        require(memory_mb >= 64, self.name, f"memory_mb must be >= 64 (the interpreter's own), got {memory_mb}")
        self.tests = tests
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.output_chars = output_chars
        self.max_program_chars = max_program_chars
        self.python = python
        self.format_penalty = format_penalty
        self._problem: Problem | None = None
        self._cases: list[list[Any]] = []
        self._answers: list[Any] = []
        self._score = 0.0
        self._turn = 0

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode_seed = resolve_seed(seed)
        rng = random.Random(episode_seed)
        problem = rng.choice(PROBLEMS)(rng)
        self._problem, self._score, self._turn = problem, 0.0, 0
        self._cases = [problem.make_args(rng) for _ in range(self.tests)]
        self._answers = [problem.answer(*args) for args in self._cases]
        example = f"{call_text(self._cases[0])} == {self._answers[0]!r}"
        obs = (
            f"Write a Python function `{problem.signature}` that {problem.statement}.\n"
            f"Example: {example}\n"
            f"Answer with the whole program in a ```python code block."
        )
        return obs, {"seed": episode_seed, "tests": self.tests}

    def sample_action(self, rng: random.Random) -> str | None:
        if self._problem is None:
            return None
        guess = rng.choice(["0", "None", "[]", "args[0]", "list(reversed(args[0]))"])
        return f"```python\ndef solve(*args):\n    return {guess}\n```"

    def step(self, action: str) -> StepResult:
        if self._problem is None:
            raise not_running(self.name)
        self._turn += 1
        last = self._turn >= self.max_turns
        info: Info = {"turn": self._turn, "tests": self.tests, "format_error": False, "success": False}
        program = extract_program(action)
        if "solve" not in program:
            info["format_error"] = True
            obs = f"No program defining `{self._problem.signature}` found." + self._next_turn(last)
            return self._end(obs, self.format_penalty, False, last, info)
        if len(program) > self.max_program_chars:
            failure, passed = f"The program is over {self.max_program_chars} characters.", 0
        else:
            run = self.run_program(program)
            failure, passed = self._judge(run)
            info["timed_out"] = run.timed_out
        score = passed / self.tests
        reward, self._score = score - self._score, score
        info.update(passed=passed, score=score, success=passed == self.tests)
        if info["success"]:
            return self._end(f"All {self.tests} tests passed.", reward, True, False, info)
        obs = f"{passed} of {self.tests} tests passed. {failure}" + self._next_turn(last)
        return self._end(obs, reward, False, last, info)

    def _next_turn(self, last: bool) -> str:
        left = self.max_turns - self._turn
        return (
            "" if last else f"\nTurns left: {left}. Answer with the whole corrected program in a ```python code block."
        )

    def _end(self, obs: str, reward: float, terminated: bool, truncated: bool, info: Info) -> StepResult:
        if terminated or truncated:
            self._problem = None
        return obs, reward, terminated, truncated, info

    def _judge(self, run: Run) -> tuple[str, int]:
        """(what went wrong, tests passed) from one run of the program."""
        return judge(run, self._cases, self._answers, self.timeout_s)

    def run_program(self, program: str) -> Run:
        """Run `program` on this episode's cases in a child process under the env's limits."""
        return run_cases(
            program,
            self._cases,
            python=self.python,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_chars=self.output_chars,
        )
