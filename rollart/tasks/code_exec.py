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

The runner and the grader stand apart from the episode, as `run_cases` (any cases, any function
name) and `judge`: the `code_tests` reward (`rollart.rewards.functions`) scores a dataset's coding
problems with them, in the reward workers' sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from rollart.envs.base import FORMAT_PENALTY, Env, Info, StepResult, not_running, require, resolve_seed
from rollart.tasks.code_problems import PROBLEMS, Problem

SYSTEM_PROMPT = (
    "Write the Python function asked for. Answer with the whole program in one ```python code block;"
    " it is run against hidden tests."
)
ERROR_CHARS = 300
"""The longest error message or value an observation quotes."""
RESULTS_BYTES = 1 << 20
"""The most a harness may report; a program whose outputs are bigger fails every test."""

HARNESS = r"""
import json, os, resource, sys
cpu_s, memory_mb, results_fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for which, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_mb << 20),
                     (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))
results = os.fdopen(results_fd, "w")
task = json.loads(sys.stdin.read())
def describe(exc):
    return f"{type(exc).__name__}: {exc}"[:300]
try:
    namespace = {"__name__": "solution"}
    exec(compile(task["program"], "<program>", "exec"), namespace)
    solve = namespace[task.get("function", "solve")]
except BaseException as exc:
    report = {"load_error": describe(exc)}
else:
    outputs = []
    for args in task["cases"]:
        try:
            outputs.append(["ok", solve(*args)])
        except BaseException as exc:
            outputs.append(["error", describe(exc)])
    report = {"outputs": outputs}
results.write(json.dumps(report, default=repr))
results.close()
"""


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(reply: str) -> str:
    """The program in a reply: its last ```python (or bare ```) fenced block, else the whole reply."""
    blocks = _FENCE.findall(reply)
    return blocks[-1] if blocks else reply


def _call(args: list[Any], function: str = "solve") -> str:
    return f"{function}({', '.join(repr(a) for a in args)})"


def _clip(text: str, limit: int = ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Run:
    """What one program did: the harness's report (None if it sent none), the exit, the output's tail."""

    report: dict[str, Any] | None
    returncode: int
    timed_out: bool
    output: str


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
        example = f"{_call(self._cases[0])} == {self._answers[0]!r}"
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


def judge(
    run: Run, cases: list[list[Any]], answers: list[Any], timeout_s: float, *, function: str = "solve"
) -> tuple[str, int]:
    """(what went wrong, tests passed) from one run of a program on `cases`, whose right results are
    `answers`: a result passes when it equals its answer and has its type (1 is not 1.0 nor True).
    What went wrong is "" when every test passed, else a message for the model: the first failing
    case, or that the program did not load, timed out or crashed, with the end of its output."""
    shown = f"\nIts output (the end):\n{run.output}" if run.output.strip() else ""
    if run.timed_out:
        return f"The program did not finish within {timeout_s:g} s.{shown}", 0
    report = run.report
    if report is None:
        how = f"signal {-run.returncode}" if run.returncode < 0 else f"exit code {run.returncode}"
        return f"The program crashed ({how}) before reporting.{shown}", 0
    if "load_error" in report:
        return f"The program failed to load: {_clip(str(report['load_error']))}{shown}", 0
    outputs = report.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return f"The program's results were lost.{shown}", 0
    passed, first = 0, ""
    for args, answer, output in zip(cases, answers, outputs, strict=True):
        kind, value = output if isinstance(output, list) and len(output) == 2 else ("error", "no result")
        if kind == "ok" and value == answer and type(value) is type(answer):
            passed += 1
        elif not first:
            call = _call(args, function)
            got = f"raised {_clip(str(value))}" if kind != "ok" else f"returned {_clip(repr(value))}"
            first = f"First failure: {call} {got}; expected {answer!r}.{shown}"
    return first, passed


def run_cases(
    program: str,
    cases: list[list[Any]],
    *,
    python: str = sys.executable,
    timeout_s: float,
    memory_mb: int,
    output_chars: int,
    function: str = "solve",
) -> Run:
    """Run `program` in a child process (`python -I -c HARNESS`) and call its `function` on each case's
    arguments, under the limits: `timeout_s` of wall time, then its process group is killed; an
    address space of `memory_mb`; its stdout and stderr kept to their last `output_chars`."""
    payload = json.dumps({"program": program, "cases": cases, "function": function}).encode()
    limits = [str(int(timeout_s) + 1), str(memory_mb)]
    results_r, results_w = os.pipe()
    with tempfile.TemporaryDirectory(prefix="rollart-code-") as cwd:
        try:
            proc = subprocess.Popen(
                [python, "-I", "-c", HARNESS, *limits, str(results_w)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(results_w,),
                cwd=cwd,
                env={"PATH": os.defpath},
                start_new_session=True,
            )
        finally:
            os.close(results_w)
        try:
            return _collect(proc, payload, results_r, timeout_s, output_chars)
        finally:
            os.close(results_r)
            _kill_group(proc)
            if proc.stdout is not None:
                proc.stdout.close()


def _collect(proc: subprocess.Popen[bytes], payload: bytes, results_r: int, timeout_s: float, output_chars: int) -> Run:
    """Feed the child, read its output (keeping the tail) and its report until both end or the time is up."""
    assert proc.stdin is not None and proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    try:
        proc.stdin.write(payload)  # read whole by the harness before anything else runs
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died first; its exit says how
    output, report = bytearray(), bytearray()
    keep = max(output_chars, 1) * 4  # bytes enough for that many characters of UTF-8
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, output)
        selector.register(results_r, selectors.EVENT_READ, report)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc)
                return Run(None, -signal.SIGKILL, True, _tail(output, output_chars))
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.data is output:
                    output += chunk
                    del output[:-keep]
                elif len(report) <= RESULTS_BYTES:
                    report += chunk
    try:
        code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:  # its pipes closed, yet it runs on
        _kill_group(proc)
        return Run(None, -signal.SIGKILL, True, _tail(output, output_chars))
    return Run(_decode(report), code, False, _tail(output, output_chars))


def _tail(output: bytearray, output_chars: int) -> str:
    text = output.decode(errors="replace")
    return text if len(text) <= output_chars else "..." + text[-output_chars:]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child and whatever it left running in its process group (one that made a session of
    its own escapes: the worker sandbox's pid namespace ends it with the worker)."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone: nothing was left behind
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _decode(report: bytearray) -> dict[str, Any] | None:
    if not report or len(report) > RESULTS_BYTES:
        return None
    try:
        decoded = json.loads(report)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None
