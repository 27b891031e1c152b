"""Env worker processes: envs that can be killed, under limits, without the node's secrets.

Real worker processes running the envs of `tests/unit/worker_envs.py` (a user's module, named in
`env_modules` and imported only by the workers), and the env-host's placement of a topology's
tasks between threads and workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollart.envexec import (
    EnvRunner,
    EnvWorkerPool,
    WorkerEnvRunner,
    WorkerLimits,
    child_environ,
    is_builtin,
)
from rollart.envexec.wire import WorkerReplyError
from rollart.envs import EnvFailure
from rollart.errors import ConfigError
from rollart.nodes.env_host import EnvHostNode
from rollart.protocol.memory import MemoryNetwork
from rollart.protocol.messages import Generate, Generated
from rollart.rollout.config import SamplingSpec, TaskSpec
from rollart.rollout.render import ChatRenderer
from rollart.rollout.trajectory import TrajectoryJob, run_trajectory
from rollart.rollout.turns import EpisodeContext
from rollart.topology import parse_topology
from tests.support import ROOT

ENVS = "tests.unit.worker_envs"
MakePool = Callable[..., Awaitable[EnvWorkerPool]]


@pytest.fixture
async def make_pool() -> AsyncIterator[MakePool]:
    pools: list[EnvWorkerPool] = []

    async def make(**kwargs: Any) -> EnvWorkerPool:
        pool = EnvWorkerPool(**{"processes": 1, "env_modules": [ENVS], **kwargs})
        pools.append(pool)
        await pool.start()
        return pool

    yield make
    for pool in pools:
        await pool.close()


async def exit_of(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until process `pid` has exited (a pidfd becomes readable then)."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone (and reaped) already
        return
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, timeout_s)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def episode(pool: EnvWorkerPool, **kwargs: Any) -> tuple[WorkerEnvRunner, int]:
    """An env of the test module, reset; its runner and the pid its reset ran in."""
    runner = await pool.open("test-worker", kwargs, timeout_s=10)
    _, info = await runner.reset(seed=1)
    return runner, info["pid"]


# --- the process runner ---------------------------------------------------------------------


async def test_an_episode_runs_in_a_worker_process_with_the_runner_interface(make_pool: MakePool) -> None:
    pool = await make_pool(processes=2)
    runner, pid = await episode(pool)
    assert pid != os.getpid() and pid in pool.pids() and runner.pid == pid
    assert (runner.max_turns, runner.system_prompt, runner.profile) == (2, "test", "decode-heavy")
    other, other_pid = await episode(pool)  # a new env goes to the worker with the fewest
    assert other_pid != pid
    await other.close()
    assert await runner.step("left") == ("you said left", 1.0, False, False, {"pid": pid, "answer": "left"})
    *_, terminated, _, _ = await runner.step("right")
    assert terminated
    await runner.close()
    await runner.close()  # idempotent
    with pytest.raises(EnvFailure, match=r"step\(\) refused: the runner is closed"):
        await runner.step("up")


async def test_a_raising_env_fails_its_call_and_the_worker_serves_on(make_pool: MakePool) -> None:
    pool = await make_pool()
    bad, pid = await episode(pool, on_step="raise")
    good, same_pid = await episode(pool)
    with pytest.raises(EnvFailure, match=r"env 'test-worker': step\(\) raised ValueError: boom"):
        await bad.step("x")
    assert await good.step("x") == ("you said x", 1.0, False, False, {"pid": pid, "answer": "x"})
    assert same_pid == pid and pool.pids() == [pid]
    await bad.close()
    with pytest.raises(EnvFailure, match=r"make\(\) raised ConfigError: unknown env 'no-such-env'"):
        await pool.open("no-such-env", timeout_s=5)


async def test_a_reply_of_the_wrong_kind_fails_its_call_and_the_pool_goes_on(make_pool: MakePool) -> None:
    pool = await make_pool()
    liar, pid = await episode(pool, on_step="lie")  # its worker answers the step with `Closed`
    good, same_pid = await episode(pool)
    with pytest.raises(WorkerReplyError) as failed:
        await liar.step("x")
    message = str(failed.value)
    assert f"env 'test-worker': step() failed: its env worker 0 (pid {pid}) answered with a 'closed' reply" in message
    assert "where 'step-done' or 'failed' was due: Closed(call=" in message
    assert isinstance(failed.value, EnvFailure)  # a failed env call to its trajectory, like any other
    assert liar.broken
    with pytest.raises(EnvFailure, match=r"step\(\) refused: the env is broken"):
        await liar.step("y")
    assert await good.step("x") == ("you said x", 1.0, False, False, {"pid": pid, "answer": "x"})
    assert same_pid == pid and pool.pids() == [pid] and pool.counts["died"] == 0
    await liar.close()
    await good.close()


async def test_a_hung_step_kills_its_worker_and_the_pool_serves_new_envs(make_pool: MakePool) -> None:
    pool = await make_pool()
    hung = await pool.open("test-worker", {"on_step": "hang"}, timeout_s=0.5)
    await hung.reset(seed=1)
    bystander, pid = await episode(pool)
    with pytest.raises(EnvFailure, match=rf"step\(\) timed out after 0.5 s; its env worker 0 \(pid {pid}\) was killed"):
        await hung.step("x")
    assert gone(pid) and hung.broken and pool.counts["timeouts"] == 1
    with pytest.raises(EnvFailure, match=r"refused: the env is broken"):
        await hung.step("x")
    # The other env of that worker refuses, naming why its worker is gone.
    with pytest.raises(EnvFailure, match=r"step\(\) refused: its env worker 0 .* died: killed by the pool: .*deadline"):
        await bystander.step("x")
    await hung.close()
    await bystander.close()
    fresh, new_pid = await episode(pool)
    assert new_pid != pid and pool.pids() == [new_pid]
    await fresh.step("x")


async def test_a_cancelled_call_still_has_its_deadline_so_a_hung_env_does_not_stay(make_pool: MakePool) -> None:
    pool = await make_pool()
    hung = await pool.open("test-worker", {"on_step": "hang"}, timeout_s=0.5)
    await hung.reset(seed=1)
    pid = hung.pid
    step = asyncio.ensure_future(hung.step("x"))
    await asyncio.sleep(0)  # the step is sent
    step.cancel()  # the trajectory was cancelled (a redundant one, say); nobody waits for the step
    with pytest.raises(asyncio.CancelledError):
        await step
    await hung.close()  # waits briefly for the running step, then leaves it
    await exit_of(pid)  # killed at the step's deadline all the same
    assert pool.counts["timeouts"] == 1


@pytest.mark.parametrize(
    ("on_step", "cause"),
    [
        ("exit", r"exited with code 3"),
        ("segfault", r"killed by SIGSEGV \(a crash in native code\)"),
        ("hang", r"killed by SIGKILL \(.*OOM killer, or another process\)"),  # killed from outside
        ("deep", r"killed by the pool: it sent a reply that is not valid: maximum recursion depth exceeded"),
    ],
)
async def test_a_worker_that_dies_fails_its_calls_with_the_cause(make_pool: MakePool, on_step: str, cause: str) -> None:
    pool = await make_pool()
    runner, pid = await episode(pool, on_step=on_step)
    step = asyncio.ensure_future(runner.step("x"))
    if on_step == "hang":
        await asyncio.sleep(0)  # the step is sent
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EnvFailure, match=rf"step\(\) failed: its env worker 0 \(pid {pid}\) died: {cause}"):
        await step
    assert gone(pid) and pool.counts["died"] == 1
    await runner.close()
    fresh, new_pid = await episode(pool)
    assert new_pid != pid
    await fresh.close()


# --- limits ---------------------------------------------------------------------------------


async def test_the_cpu_time_limit_kills_a_spinning_worker_and_says_so(make_pool: MakePool) -> None:
    pool = await make_pool(limits=WorkerLimits(cpu_time_s=1))
    runner, pid = await episode(pool, on_step="spin")
    with pytest.raises(EnvFailure, match=rf"\(pid {pid}\) died: killed by SIGXCPU \(cpu_time_s 1 exceeded\)"):
        await runner.step("x")  # its deadline (10 s) is far: the limit ends it first
    assert gone(pid)


async def test_a_worker_past_half_its_cpu_time_is_replaced_and_stopped_once_idle(make_pool: MakePool) -> None:
    pool = await make_pool(limits=WorkerLimits(cpu_time_s=2))
    runner, pid = await episode(pool, on_step="burn")
    await runner.step("x")  # its worker has now used 1.2 of its 2 CPU seconds: it takes no new envs
    assert pool.counts["retired"] == 1
    fresh, new_pid = await episode(pool)
    assert new_pid != pid
    await runner.step("x")  # the old worker still serves the env it has
    await runner.close()  # ... and is stopped once that env is closed
    await exit_of(pid)
    assert new_pid in pool.pids() and pool.counts["died"] == 0
    await fresh.step("x")
    await fresh.close()


async def test_the_memory_limit_fails_the_allocating_call_only(make_pool: MakePool) -> None:
    pool = await make_pool(limits=WorkerLimits(memory_mb=200))
    runner, pid = await episode(pool, on_step="allocate")
    with pytest.raises(EnvFailure, match=r"step\(\) raised MemoryError.*memory_mb limit is 200"):
        await runner.step("x")  # 1 GiB
    await runner.close()
    survivor, same_pid = await episode(pool)
    assert same_pid == pid
    await survivor.close()


async def test_the_open_files_limit_fails_the_call_that_opens_too_many(make_pool: MakePool) -> None:
    pool = await make_pool(limits=WorkerLimits(open_files=32))
    runner, _ = await episode(pool, on_step="open-files")
    with pytest.raises(EnvFailure, match=r"raised OSError: \[Errno 24\] Too many open files.*open_files limit is 32"):
        await runner.step("x")  # 100 files
    await runner.close()


# --- secrets --------------------------------------------------------------------------------


def test_the_worker_environment_drops_the_node_secrets_and_credentials() -> None:
    environ = {
        "PATH": "/bin",
        "HOME": "/home/me",
        "TOKENIZERS_PARALLELISM": "false",
        "MY_RUN_KEYS": "secret",  # the topology's run.secret_env: dropped whatever it is called
        "ROLLART_ADMIN_TOKEN": "t",
        "ROLLART_ANYTHING": "x",
        "HF_TOKEN": "hf",
        "AWS_SECRET_ACCESS_KEY": "aws",
        "OPENAI_API_KEY": "oa",
        "DB_PASSWORD": "pw",
        "SSH_AUTH_SOCK": "/tmp/agent",
        "SANDBOX_API_KEY": "needed",
    }
    env = child_environ(environ, drop=["MY_RUN_KEYS"], keep=["SANDBOX_API_KEY", "MY_RUN_KEYS"])
    assert sorted(env) == ["HOME", "MALLOC_ARENA_MAX", "PATH", "SANDBOX_API_KEY", "TOKENIZERS_PARALLELISM"]


async def test_an_env_in_a_worker_sees_no_secret_of_its_env_host(
    make_pool: MakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {"ROLLART_SECRET": "s3cr3t-value", "ROLLART_ADMIN_TOKEN": "t0ken-value", "RUN7_S": "other-s3cr3t"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HARMLESS_SETTING", "kept")
    pool = await make_pool(environ=child_environ(os.environ, drop=["RUN7_S"]))
    runner = await pool.open("test-worker", {"show_environ": True}, timeout_s=10)
    obs, _ = await runner.reset(seed=1)
    seen = json.loads(obs)
    assert "HARMLESS_SETTING" in seen["os_environ"]
    for name, value in secrets.items():
        assert name not in seen["os_environ"]
        assert value not in seen["proc_environ"]  # not merely unset: never in the process's environment
    await runner.close()


def test_workers_die_with_their_env_host_even_when_it_is_killed() -> None:
    script = (
        "import asyncio\n"
        "from rollart.envexec import EnvWorkerPool\n"
        "async def main():\n"
        "    async with EnvWorkerPool(processes=2) as pool:\n"
        "        print('PIDS', *pool.pids(), flush=True)\n"
        "        await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert host.stdout is not None
    line = ""
    while not line.startswith("PIDS"):  # (its log lines come first)
        line = host.stdout.readline()
        assert line, "the env-host exited before its workers were ready"
    pids = [int(p) for p in line.split()[1:]]
    watches = [os.pidfd_open(pid) for pid in pids]
    host.kill()  # SIGKILL: no drain, no clean-up of its own
    host.wait()
    host.stdout.close()
    try:
        for fd in watches:  # a pidfd is readable once its process has exited
            assert select.select([fd], [], [], 10)[0], "a worker outlived its killed env-host"
    finally:
        for fd in watches:
            os.close(fd)


# --- placement and the env-host -------------------------------------------------------------


def test_only_rollarts_own_envs_count_as_builtin() -> None:
    assert is_builtin("frozen-lake", {})
    assert is_builtin("flaky", {"inner": "sokoban"})
    assert not is_builtin("flaky", {"inner": "test-worker"})  # wraps a user env
    assert not is_builtin("gym:FrozenLake-v1", {}) and not is_builtin("gem:game:Sudoku-v0", {})
    assert not is_builtin("frozen-lake", {}, frozenset({"frozen-lake"}))  # replaced by an env module


class ByteTokenizer:
    """One token per byte, a bare chat template: what `ChatRenderer` needs, by hand."""

    eos_token_id = None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in conversation)
        return text + ("<assistant>" if kwargs.get("add_generation_prompt") else "")

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def convert_tokens_to_ids(self, token: str) -> None:
        return None

    def convert_ids_to_tokens(self, ids: int) -> None:
        return None


class ScriptedProxy:
    """A generator that always replies "left"."""

    async def generate(self, task: str, request: Generate) -> Generated:
        ids = list(b"left")
        return Generated(request.request_id, ids, [-0.5] * len(ids), [0] * len(ids), "stop", 1, "gen-0")

    def forget(self, trajectory_id: str) -> None:
        pass


def env_host(tmp_path: Path, isolation: str, tasks: str) -> EnvHostNode:
    topology = parse_topology(
        f"run:\n"
        f"  run_dir: {tmp_path}\n"
        f"  secret_env: RUN7_S\n"
        f"  env_modules: [{ENVS}]\n"
        f"  rollout:\n"
        f"    env_workers: {{isolation: {isolation}, processes: 1, pass_env: [SANDBOX_API_KEY]}}\n"
        f"    tasks: [{tasks}]\n"
        "nodes:\n"
        "  - {name: env-0, role: env-host, port: 9901, admin_port: 9902}\n"
    )
    return EnvHostNode(topology, topology.node("env-0"), secret=b"s", admin_token=None, network=MemoryNetwork())


async def test_the_env_host_runs_user_envs_in_workers_and_its_own_in_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUN7_S", "the-session-secret")
    monkeypatch.setenv("SANDBOX_API_KEY", "for-the-env")
    tasks = "{name: mine, env: test-worker}, {name: lake, env: frozen-lake}, {name: sim, env: sim}"
    node = env_host(tmp_path, "auto", tasks)
    assert "RUN7_S" not in node.envs.pool.environ and node.envs.pool.environ["SANDBOX_API_KEY"] == "for-the-env"
    try:
        traits = await node.envs.prepare({t.name: (t.env, t.env_kwargs) for t in node.rollout.tasks})  # type: ignore[union-attr]
        assert {task: t.placement for task, t in traits.items()} == {"mine": "process", "lake": "thread", "sim": "loop"}
        assert traits["mine"].profile == "decode-heavy" and traits["mine"].max_turns == 2
        for task, kind in (("mine", WorkerEnvRunner), ("lake", EnvRunner)):
            env = await node.envs.open(task, timeout_s=10)
            assert isinstance(env, kind)
            spec = TaskSpec(name=task, env="-", max_turns=2)
            job = TrajectoryJob(f"{task}.0", "g", spec, 1, SamplingSpec(), 10.0)
            context = EpisodeContext(
                ChatRenderer(ByteTokenizer()),  # type: ignore[arg-type]
                ScriptedProxy(),
                score=lambda request: asyncio.sleep(0, request.env_reward),
                policy_version=lambda: 0,
            )
            result = await run_trajectory(job, env, context)
            assert result.turns >= 1 and bytes(result.response_ids).startswith(b"left")
            assert env.closed  # type: ignore[attr-defined]
        assert node.envs.status()["workers"]["started"] == 1
    finally:
        await node.envs.close()
    assert not node.envs.pool.pids()


async def test_isolation_process_puts_builtins_in_workers_and_thread_puts_everything_in_the_host(
    tmp_path: Path,
) -> None:
    process = env_host(tmp_path, "process", "{name: lake, env: frozen-lake}, {name: sim, env: sim}")
    thread = env_host(tmp_path, "thread", "{name: mine, env: test-worker}")
    try:
        placed = await process.envs.prepare({"lake": ("frozen-lake", {}), "sim": ("sim", {})})
        assert (placed["lake"].placement, placed["sim"].placement) == ("process", "loop")
        lake = await process.envs.open("lake", timeout_s=10)
        assert isinstance(lake, WorkerEnvRunner)
        obs, _ = await lake.reset(seed=3)
        assert obs  # a built-in, built by name in the worker
        await lake.close()
        placed = await thread.envs.prepare({"mine": ("test-worker", {})})  # imports the module here
        assert placed["mine"].placement == "thread" and not thread.envs.status().get("workers")
    finally:
        await process.envs.close()
        await thread.envs.close()


async def test_a_broken_env_module_is_a_config_error_naming_it(make_pool: MakePool) -> None:
    with pytest.raises(ConfigError, match=r"run.env_modules: cannot import env module 'no_such_pkg.envs'"):
        await make_pool(env_modules=["no_such_pkg.envs"])


def test_env_worker_settings_out_of_range_are_named() -> None:
    nodes = "nodes:\n  - {name: env-0, role: env-host, port: 9901, admin_port: 9902}\n"
    bad = "{processes: 0, cpu_time_s: 0, memory_mb: 64, open_files: 8}"
    with pytest.raises(ConfigError) as error:
        parse_topology(f"run:\n  rollout:\n    env_workers: {bad}\n    tasks: [{{name: a, env: sim}}]\n" + nodes)
    for key in ("processes", "cpu_time_s", "memory_mb", "open_files"):
        assert f"run.rollout.env_workers.{key}: expected an integer >=" in str(error.value)
    sandbox = "run:\n  rollout:\n    env_workers: {isolation: sandbox}\n    tasks: [{name: a, env: sim}]\n"
    with pytest.raises(ConfigError, match=r"run.rollout.env_workers.isolation: expected one of auto, process, thread"):
        parse_topology(sandbox + nodes)
