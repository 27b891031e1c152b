"""The `code` task: programs run in a child process against hidden tests, under limits.

Real child processes, no mocks: right and wrong programs, and the ones a model (or an attacker)
writes by accident or on purpose: an endless loop, megabytes of output, a syntax error, a crash,
a memory hog, a forged result, a look at the environment and the descriptors it was given.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from rollart.envs import make_env
from rollart.tasks.code_exec import CodeEnv, extract_program
from rollart.tasks.code_problems import PROBLEMS

SOLUTIONS = {
    "sum of the even numbers": "def solve(xs):\n    return sum(x for x in xs if x % 2 == 0)",
    "multiples of": "def solve(xs):\n    return sum(1 for x in xs if x % M == 0)",
    "without repeated values": "def solve(xs):\n    return list(dict.fromkeys(xs))",
    "running sums": "import itertools\ndef solve(xs):\n    return list(itertools.accumulate(xs))",
    "rotated left": "def solve(xs, k):\n    k = k % len(xs) if xs else 0\n    return xs[k:] + xs[:k]",
    "decimal digits": "def solve(n):\n    return sum(map(int, str(abs(n))))",
    "second largest": "def solve(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) > 1 else None",
}
"""A right program for each template, as a model would write it from the statement alone."""


def fenced(program: str) -> str:
    return f"Here is my solution:\n```python\n{program}\n```\nIt should work."


def solution(obs: str) -> str:
    (key,) = [key for key in SOLUTIONS if key in obs]
    program = SOLUTIONS[key]
    if "multiples of" in obs:
        program = program.replace("M", obs.split("multiples of ")[1].split(".", maxsplit=1)[0])
    return program


def episode(seed: int = 0, **kwargs: object) -> tuple[CodeEnv, str]:
    env = make_env("code", **kwargs)
    assert isinstance(env, CodeEnv)
    obs, info = env.reset(seed=seed)
    assert info["seed"] == seed
    return env, obs


def test_every_template_is_solvable_as_stated() -> None:
    seen = set()
    for seed in range(200):
        env, obs = episode(seed)
        assert "Example: solve(" in obs and "```python" in obs
        reply, reward, terminated, truncated, info = env.step(fenced(solution(obs)))
        assert (reward, terminated, truncated) == (1.0, True, False), (obs, reply)
        assert info["success"] and info["passed"] == info["tests"] == 6
        seen.add(next(key for key in SOLUTIONS if key in obs))
        if len(seen) == len(PROBLEMS):
            break
    assert seen == set(SOLUTIONS)


def test_wrong_program_gets_partial_credit_and_a_second_turn() -> None:
    env, obs = episode(3)  # multiples of 3
    assert "multiples of 3" in obs
    wrong = "def solve(xs):\n    return sum(1 for x in xs if x % 3 == 0 and x > 0)"  # misses the negatives and 0
    obs, reward, terminated, truncated, info = env.step(fenced(wrong))
    assert not terminated and not truncated and 0 <= reward < 1 and reward == info["score"]
    assert f"{info['passed']} of 6 tests passed. First failure: solve([" in obs
    assert "; expected " in obs and "Turns left: 1." in obs
    obs, second, terminated, truncated, info = env.step(fenced(solution("multiples of 3.")))
    assert terminated and not truncated and info["success"] and obs == "All 6 tests passed."
    assert reward + second == pytest.approx(1.0)  # an episode's rewards sum to its last score


def test_turn_limit_truncates() -> None:
    env, _ = episode(0, max_turns=2)
    rewards = []
    for turn in (1, 2):
        obs, reward, terminated, truncated, info = env.step(fenced("def solve(*args):\n    return 'nope'"))
        rewards.append(reward)
        assert (terminated, truncated, info["turn"]) == (False, turn == 2, turn)
    assert "Turns left" not in obs and rewards == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="no episode running"):
        env.step("anything")


def test_raised_error_is_quoted_and_clipped() -> None:
    env, _ = episode(0)
    obs, *_ = env.step(fenced("def solve(*args):\n    raise ValueError('x' * 100000)"))
    assert "raised ValueError: xxx" in obs and len(obs) < 800


def test_infinite_loop_is_stopped_by_the_timeout() -> None:
    env, _ = episode(0, timeout_s=1.0)
    started = time.monotonic()
    obs, reward, terminated, _, info = env.step(fenced("def solve(xs):\n    while True:\n        pass"))
    assert time.monotonic() - started < 5
    assert "did not finish within 1 s" in obs and info["timed_out"] and reward == 0.0 and not terminated


def test_megabytes_of_output_are_bounded() -> None:
    env, obs = episode(1, output_chars=200)
    program = "import sys\nsys.stdout.write('y' * 20_000_000)\nprint('the end')\n" + solution(obs)
    started = time.monotonic()
    _, reward, _, _, info = env.step(fenced(program))
    assert time.monotonic() - started < 10
    assert info["success"] and reward == 1.0  # what it prints does not matter, nor stall it
    env, _ = episode(1, output_chars=200)
    run = env.run_program("print('z' * 5_000_000)\nimport os\nos._exit(7)")
    assert len(run.output) <= 203 and "z" * 190 in run.output and (run.report, run.returncode) == (None, 7)


def test_syntax_error_is_reported() -> None:
    env, _ = episode(0)
    obs, reward, *_ = env.step(fenced("def solve(xs)\n    return 1"))
    assert "The program failed to load: SyntaxError" in obs and reward == 0.0


def test_crash_and_memory_hog_are_reported() -> None:
    env, _ = episode(0)
    obs, *_ = env.step(fenced("import os\nprint('bye', flush=True)\nos._exit(3)\ndef solve(xs): pass"))
    assert "crashed (exit code 3) before reporting" in obs and "bye" in obs
    env, _ = episode(0, memory_mb=128)
    obs, *_ = env.step(fenced("hog = bytearray(1 << 30)\ndef solve(xs): pass"))
    assert "failed to load: MemoryError" in obs


def test_no_program_is_a_format_error() -> None:
    env, _ = episode(0)
    obs, reward, terminated, truncated, info = env.step("I think the answer is 4.")
    assert info["format_error"] and reward == -0.1 and not terminated and not truncated
    assert "No program defining `solve(" in obs


def test_hostile_program_cannot_forge_its_results() -> None:
    # An object equal to everything, and a report written straight to the harness's pipe: both are
    # judged by the env, on the outputs as JSON, against answers the child never saw.
    env, _ = episode(0)
    always = "class Yes:\n    def __eq__(self, other):\n        return True\ndef solve(*args):\n    return Yes()"
    obs, reward, *_ = env.step(fenced(always))
    assert reward == 0.0 and "returned '<" in obs
    env, _ = episode(0)
    forged = (
        "import json, os, sys\nfd = int(sys.argv[3])\n"
        "os.write(fd, json.dumps({'outputs': [['ok', 1]] * 6}).encode())\nos._exit(0)\ndef solve(xs): pass"
    )
    *_, info = env.step(fenced(forged))
    assert not info["success"] and info["passed"] < 6


def test_hostile_program_sees_no_secrets_nor_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLART_SECRET", "s3cret")
    leaked = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leaked, True)
    try:
        program = (
            "import json, os\nprint(json.dumps([dict(os.environ), sorted(map(int, os.listdir('/proc/self/fd')))]))"
        )
        env, _ = episode(0)
        run = env.run_program(program)
    finally:
        os.close(leaked)
    environ, fds = json.loads(run.output.strip())
    assert environ.get("PATH") == os.defpath and set(environ) <= {"PATH", "LC_CTYPE"}  # (C locale coercion)
    assert leaked not in fds and len(fds) <= 5  # stdin, stdout, stderr, the results pipe, the listing's own


def test_extract_program() -> None:
    assert extract_program("```python\na = 1\n```\nthen\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_program("```\nc = 3\n```") == "c = 3\n"
    assert extract_program("def solve(xs): return 0") == "def solve(xs): return 0"


def test_same_seed_same_episode_and_sampled_actions_are_programs() -> None:
    a, b = make_env("code"), make_env("code")
    assert a.reset(seed=11) == b.reset(seed=11)
    assert len({make_env("code").reset(seed=s)[0] for s in range(30)}) >= 20
    rng = random.Random(0)
    assert a.sample_action(rng) is not None
    for _ in range(2):
        reply = a.sample_action(rng)
        assert reply is not None and reply.startswith("```python\ndef solve(")
        *_, info = a.step(reply)
        assert not info["format_error"]
    assert a.sample_action(rng) is None  # the episode is over


def test_arguments_are_checked() -> None:
    from rollart.errors import ConfigError

    with pytest.raises(ConfigError, match="'code': memory_mb must be >= 64"):
        make_env("code", memory_mb=16)
    with pytest.raises(ConfigError, match="tests must be >= 1"):
        make_env("code", tests=0)
