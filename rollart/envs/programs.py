"""Running a model's Python program on test cases, in a child process under limits, and grading it.

`run_cases` runs `python -I -c HARNESS`, given the program and the cases' arguments on stdin: no
inherited descriptors but its pipes, an environment of PATH alone, its own empty working directory
and process group, `timeout_s` of wall time (then the group is killed), CPU, address-space,
file-size and open-file limits set by the harness before the program is loaded; its stdout and
stderr are kept to their last `output_chars`. The harness reports what the function returned for
each case on a pipe of its own. `judge` compares those outputs with the answers, which never reach
the child, so a program that forges the report gains nothing.

The child is not a sandbox: it runs as its caller does. The `code` env (`rollart.tasks.code_exec`)
runs it in env worker processes, the `code_tests` reward (`rollart.rewards.functions`) in reward
worker processes, and both inherit those workers' sandbox (`rollart.workers.sandbox`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

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


def call_text(args: list[Any], function: str = "solve") -> str:
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
            call = call_text(args, function)
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
