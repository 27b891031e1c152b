"""A GEM env in env workers that run on a Python environment of their own (`env_workers.python`).

gem-llm pins msgspec==0.19.0; installed in the node's environment it would downgrade the node's
msgspec. `bin/setup-gem` makes `.venv-gem` with gem-llm and what the env worker imports; here a
pool's workers run on that interpreter, host `gem:game:GuessTheNumber-v0-easy` and the probe env of
`gem_probe.py`, and report msgspec 0.19.0 from `.venv-gem` while this process keeps its own
msgspec. Without a sandbox and, where one can start, in the sandbox a node uses by default.

    bin/setup-gem && .venv/bin/python -m pytest tests/integration/test_gem_env.py   # or -k gem
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator

import msgspec
import pytest

from rollart.envexec import EnvWorkerPool, WorkerEnvRunner, WorkerLimits
from rollart.errors import ConfigError
from rollart.workers.sandbox import SandboxSpec, probe, worker_launch
from rollart.workers.spawn import Launch
from tests.support import ROOT

GEM_VENV = ROOT / ".venv-gem"
GEM_PYTHON = GEM_VENV / "bin" / "python"
GEM_MSGSPEC = "0.19.0"
"""What gem-llm 0.1.0 pins."""
GUESS = "gem:game:GuessTheNumber-v0-easy"
"""1 to 10 in 4 turns (gem-llm 0.1.0 registers -easy, -hard and -random, no plain -v0)."""

if not GEM_PYTHON.exists():
    pytest.skip("no .venv-gem: run bin/setup-gem", allow_module_level=True)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SANDBOXED = probe("auto") != "off"


def launch_for(where: str, python: str = str(GEM_PYTHON)) -> Launch:
    if where == "no sandbox":
        return Launch(python=python)
    if not SANDBOXED:
        pytest.skip("no sandbox here: bwrap and unshare both refused (sandbox.unavailable)")
    return worker_launch(SandboxSpec(), python=python, hide=[], what="env")


@pytest.fixture(params=["no sandbox", "sandbox"])
async def pool(request: pytest.FixtureRequest) -> AsyncIterator[EnvWorkerPool]:
    # One process, so the probe and the GEM env share a worker: the probe's report is the GEM env's too.
    limits = WorkerLimits(cpu_time_s=60, memory_mb=4096, open_files=256)
    pool = EnvWorkerPool(
        processes=1, env_modules=["tests.integration.gem_probe"], limits=limits, launch=launch_for(request.param)
    )
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def play(runner: WorkerEnvRunner) -> tuple[str, float, bool]:
    """Binary search on the env's higher/lower hints, each guess in `\\boxed{}`: the last observation,
    reward and `terminated`."""
    low, high = 1, 10
    for _ in range(runner.max_turns):
        guess = (low + high) // 2
        obs, reward, terminated, truncated, _ = await runner.step(f"I guess \\boxed{{{guess}}}")
        if terminated or truncated:
            return obs, reward, terminated
        hint = re.search(r"target number is (higher|lower) than", obs)
        assert hint, obs
        low, high = (guess + 1, high) if hint.group(1) == "higher" else (low, guess - 1)
    raise AssertionError("the game did not end within its turns")


@pytest.mark.timeout(120)
async def test_gem_env_runs_on_its_own_python(pool: EnvWorkerPool) -> None:
    probe_env = await pool.open("gem-probe", timeout_s=30)
    _, worker = await probe_env.reset(seed=0)
    await probe_env.close()
    # The worker ran .venv-gem's interpreter and gem-llm's msgspec, loaded from .venv-gem ...
    assert worker["python"] == str(GEM_PYTHON)
    assert worker["msgspec"] == GEM_MSGSPEC
    assert worker["msgspec_file"].startswith(str(GEM_VENV) + "/"), worker["msgspec_file"]
    assert worker["gem_llm"] == "0.1.0"
    # ... while this process (the node) kept its own.
    assert sys.executable != str(GEM_PYTHON)
    assert msgspec.__version__ != GEM_MSGSPEC, "the node's msgspec was downgraded to gem-llm's pin"
    assert not msgspec.__file__.startswith(str(GEM_VENV))

    guess = await pool.open(GUESS, timeout_s=60)
    try:
        assert guess.pid == probe_env.pid  # the same worker
        assert (guess.profile, guess.max_turns) == ("prefill-heavy", 4)
        obs, _ = await guess.reset(seed=7)
        assert "Guess The Number" in obs and "\\boxed{" in obs
        obs, reward, terminated = await play(guess)
        assert terminated and reward == 1.0 and obs.startswith("Congratulations"), (obs, reward)
        # A reply without \boxed{} is GEM's format error: the episode ends with its penalty.
        await guess.reset(seed=8)
        obs, reward, terminated, _, _ = await guess.step("five")
        assert terminated and reward < 0 and "did not provide a valid guess" in obs
    finally:
        await guess.close()


@pytest.mark.parametrize("where", ["no sandbox", "sandbox"])
async def test_gem_env_missing_python_is_refused(where: str) -> None:
    """A `python` that is not there is refused at start, naming the setting and the path (in a sandbox the
    launcher's failed exec would otherwise read as a worker that exited with code 127)."""
    missing = ROOT / ".venv-missing" / "bin" / "python"
    pool = EnvWorkerPool(processes=1, launch=launch_for(where, str(missing)))
    with pytest.raises(ConfigError, match=r"env_workers\.python: '.*\.venv-missing/bin/python' is not an executable"):
        await pool.start()
    assert pool.pids() == []


async def test_gem_env_relative_python_is_refused_in_a_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandboxed worker starts in its scratch directory, where a relative `python` is not found."""
    monkeypatch.chdir(ROOT)
    pool = EnvWorkerPool(processes=1, launch=launch_for("sandbox", ".venv-gem/bin/python"))
    with pytest.raises(ConfigError, match=r"'\.venv-gem/bin/python' is relative.*give an absolute path"):
        await pool.start()
