"""Hostile env code in sandboxed env workers (`rollart.workers.sandbox`), through the real pool: a user's
env module (`hostile_envs.py`) that reads a node's `/proc/<pid>/environ`, reads the secret file,
connects to a node's session and admin ports, forks without end, fills its scratch and writes outside
it. Each attempt is refused or contained: the call fails with the error that stopped it (the
trajectory's cause; the fork bomb, which never returns, with its deadline, which kills its worker and
the whole sandbox), nothing secret comes back or reaches the logs, and the pool goes on serving.
Run unsandboxed, the same module reads the secret and connects (the first test), so the tests test
the sandbox. The sandbox's own unit tests are tests/unit/test_sandbox.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rollart.envexec import EnvWorkerPool
from rollart.envs import EnvFailure
from rollart.workers.limits import WorkerLimits
from rollart.workers.sandbox import PID_MAX_MIN, SandboxSpec, probe, worker_launch
from rollart.workers.spawn import NO_SANDBOX, Launch
from tests.support import ROOT

pytestmark = pytest.mark.integration

ENVS = "tests.integration.hostile_envs"
SECRET = f"hostile-test-secret-{uuid.uuid4().hex}"
SANDBOXED = probe("auto") != "off"
needs_sandbox = pytest.mark.skipif(
    not SANDBOXED, reason="no sandbox here: bwrap and unshare both refused (sandbox.unavailable)"
)


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[int, Path, int, int]]:
    """A stand-in node: a process started with the secret in its environment, the secret file in a
    folder outside /tmp (the sandbox's /tmp is its own anyway), a session port and an admin port."""
    folder = ROOT / ".cache" / f"hostile-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    secret = folder / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    proc = subprocess.Popen(["sleep", "120"], env={"ROLLART_SECRET": SECRET, "PATH": "/usr/bin:/bin"})
    session, admin = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    try:
        yield proc.pid, secret, session.getsockname()[1], admin.getsockname()[1]
    finally:
        session.close()
        admin.close()
        proc.kill()
        proc.wait()
        secret.unlink()
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()


def host_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


async def started(launch: Launch) -> EnvWorkerPool:
    limits = WorkerLimits(cpu_time_s=30, memory_mb=2048, open_files=256)
    pool = EnvWorkerPool(processes=1, env_modules=[ENVS], limits=limits, launch=launch)
    await pool.start()
    return pool


@pytest.fixture
async def sandboxed(node: tuple[int, Path, int, int]) -> AsyncIterator[EnvWorkerPool]:
    spec = SandboxSpec(scratch_mb=16, max_processes=64)
    pool = await started(worker_launch(spec, python=sys.executable, hide=[node[1].parent], what="env"))
    try:
        yield pool
    finally:
        await pool.close()


async def attempt(pool: EnvWorkerPool, attack: str, timeout_s: float = 30, **target: object) -> str:
    """The attack's observation, or `EnvFailure`'s message when something stopped it."""
    runner = await pool.open("hostile", {"attack": attack, **target}, timeout_s=timeout_s)
    try:
        obs, _ = await runner.reset(seed=0)
    except EnvFailure as exc:
        return f"refused: {exc}"
    finally:
        await runner.close()
    return obs


@pytest.mark.timeout(60)
async def test_hostile_env_unsandboxed_gets_everything(node: tuple[int, Path, int, int]) -> None:
    """The control: without the sandbox the same module reads the secret and reaches the port."""
    pid, secret, port, _ = node
    pool = await started(NO_SANDBOX)
    try:
        assert SECRET in await attempt(pool, "environ", pid=pid)
        assert await attempt(pool, "secret", path=str(secret)) == SECRET
        assert await attempt(pool, "connect", port=port) == f"connected to {port}"
    finally:
        await pool.close()


@needs_sandbox
@pytest.mark.timeout(120)
async def test_hostile_env_is_contained(sandboxed: EnvWorkerPool, node: tuple[int, Path, int, int]) -> None:
    pid, secret, session_port, admin_port = node
    outside = ROOT / ".cache" / f"escaped-{uuid.uuid4().hex[:8]}"
    with capture_logs() as logs:
        results = {
            "environ": await attempt(sandboxed, "environ", pid=pid),
            "secret": await attempt(sandboxed, "secret", path=str(secret)),
            "session port": await attempt(sandboxed, "connect", port=session_port),
            "admin port": await attempt(sandboxed, "connect", port=admin_port),
            "fill": await attempt(sandboxed, "fill"),
            "write": await attempt(sandboxed, "write", path=str(outside)),
        }
        before = host_processes()
        bomb = asyncio.ensure_future(attempt(sandboxed, "fork", timeout_s=4))
        await asyncio.sleep(3)
        during = host_processes()
        results["fork"] = await bomb
        after = await attempt(sandboxed, "ok")
    assert after == "fine", "the pool stopped serving"
    assert not outside.exists()
    # Each refused, with the error that stopped it as the trajectory's cause:
    assert "FileNotFoundError" in results["environ"]  # the node's pid is not in the worker's pid namespace
    assert "FileNotFoundError" in results["secret"] or "PermissionError" in results["secret"]  # hidden
    for port in ("session port", "admin port"):  # no network: its own loopback, where nothing listens
        assert "OSError" in results[port] or "ConnectionRefusedError" in results[port]
    # The bomb's processes stay within the sandbox's ceiling (RLIMIT_NPROC, or the pid namespace's
    # pid_max for a root sandbox; unsandboxed, thousands in 3 s), and its call's deadline ends them all.
    assert during - before < 2 * max(64, PID_MAX_MIN), (before, during)
    assert "timed out" in results["fork"] or "deadline" in results["fork"], results["fork"]
    assert "No space left on device" in results["fill"]
    assert "Read-only file system" in results["write"]
    for outcome in results.values():
        assert outcome.startswith("refused: "), results
        assert SECRET not in outcome
    assert not any(SECRET in str(event) for event in logs)


@needs_sandbox
@pytest.mark.timeout(60)
async def test_hostile_env_sandbox_still_imports_code_under_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout or a module folder under /tmp, which the sandbox's private /tmp covers, is shown
    read-only inside (a clean clone under /tmp could not start its workers before)."""
    (tmp_path / "tmp_envs.py").write_text(
        "from tests.integration.hostile_envs import HostileEnv\n"
        "from rollart.envs import register_env\n"
        "register_env('from-tmp', HostileEnv)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = SandboxSpec(scratch_mb=16, max_processes=64)
    launch = worker_launch(spec, python=sys.executable, hide=[], what="env")
    pool = EnvWorkerPool(processes=1, env_modules=["tmp_envs"], launch=launch)
    await pool.start()
    try:
        runner = await pool.open("from-tmp", {"attack": "ok"}, timeout_s=30)
        assert (await runner.reset(seed=0))[0] == "fine"
        await runner.close()
    finally:
        await pool.close()
