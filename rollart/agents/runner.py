"""One agent episode end to end: its endpoint opened, its program run in the sandbox, its reward, its trajectory.

    open the episode on the env-host's endpoint -> start the program (OPENAI_BASE_URL, OPENAI_API_KEY) ->
    serve its calls as turns -> it exits -> reward: its own report, or the task's reward function on the
    transcript -> the trajectory, every generated token as sampled

The program gets its episode's seed (`ROLLART_EPISODE_SEED`, so it can pick its problem the way an env's
`reset(seed)` does), its id and its task's name. It runs where env workers run: in their sandbox
(`run.rollout.env_workers.sandbox`), without the node's secrets, under their limits. Without the host's network
it reaches the endpoint through `rollart.agents.relay`. A program that fails (a non-zero exit, its timeout, no
report where the reward is its report) fails its episode only, with its last lines of stderr as the cause. An
episode that is cancelled (a redundant extra that lost, too stale for alpha, the run over) closes its endpoint,
so that a call in flight or later is refused with the reason, and its program is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollart.agents.episode import AgentEpisode
from rollart.agents.openai_api import AgentEndpoint
from rollart.errors import RollartError
from rollart.protocol.messages import Generate, Generated, Score, Trajectory
from rollart.rollout.config import AgentProgram, SamplingSpec, TaskSpec
from rollart.rollout.turns import EpisodeContext
from rollart.workers.limits import WorkerLimits, set_limits
from rollart.workers.sandbox import SandboxSpec, probe, worker_launch

RELAY_PORT = 8000
"""The loopback port an agent in a sandbox without network finds its endpoint on."""
STDERR_TAIL = 2000
"""Characters of a failed program's stderr kept for its cause."""


class AgentFailed(RollartError):
    """The agent program of an episode failed; the message says how, with its last stderr."""


@dataclass(frozen=True)
class ProgramLaunch:
    """How an env-host starts agent programs: in the env workers' sandbox, environment and limits."""

    prefix: tuple[str, ...] = ()
    """The sandbox's command line (`rollart.workers.sandbox.worker_launch`); empty for none."""
    relay_to: Path | None = None
    """The endpoint's Unix socket, where the sandbox has no network: the program runs behind
    `rollart.agents.relay`, which carries a loopback port of the sandbox to it."""
    environ: Mapping[str, str] = field(default_factory=dict)
    """The environment without the node's secrets (`rollart.workers.limits.child_environ`)."""
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    described: str = "no sandbox"

    @classmethod
    def prepare(
        cls,
        sandbox: SandboxSpec,
        *,
        hide: Sequence[str | Path],
        socket: Path,
        environ: Mapping[str, str],
        limits: WorkerLimits,
    ) -> ProgramLaunch:
        """Decide once where programs run: `sandbox` with `hide` masked; behind a relay to `socket`
        (shown read-only inside) when the sandbox has no network."""
        relayed = not sandbox.network and probe(sandbox.mode) != "off"
        show = [socket.parent] if relayed else []
        launch = worker_launch(sandbox, python=sys.executable, hide=hide, what="agent", show=show)
        return cls(launch.launcher, socket if relayed else None, environ, limits, launch.described)

    def argv(self, program: AgentProgram, endpoint: AgentEndpoint, episode_id: str) -> tuple[list[str], str]:
        """The command line that runs `program`, and the base URL it reaches its episode at from where it runs."""
        # The sandbox starts its command in a scratch folder of its own: `env -C` moves to the program's
        # working directory first (the host's, read-only inside), so that its relative paths mean what they
        # say in the topology.
        cwd = os.path.abspath(program.cwd or ".")
        command = ["env", "-C", cwd, *(part.replace("{python}", sys.executable) for part in program.command)]
        if self.relay_to is None:
            return [*self.prefix, *command], endpoint.base_url(episode_id)
        relay = [sys.executable, "-m", "rollart.agents.relay", str(self.relay_to), str(RELAY_PORT), "--"]
        return [*self.prefix, *relay, *command], f"http://127.0.0.1:{RELAY_PORT}/e/{episode_id}/v1"


@dataclass(frozen=True)
class AgentHost:
    """How an env-host serves its agent episodes: their OpenAI-compatible endpoint, on loopback and on a Unix
    socket for agents in sandboxes without network (`rollart.agents.relay`), and how their programs start."""

    endpoint: AgentEndpoint
    launch: ProgramLaunch
    socket_dir: Path

    @classmethod
    async def start(
        cls,
        model_name: str,
        sandbox: SandboxSpec,
        *,
        hide: Sequence[str | Path],
        environ: Mapping[str, str],
        limits: WorkerLimits,
    ) -> AgentHost:
        """Serve the endpoint (answering as `model_name`); programs run as `ProgramLaunch.prepare` decides."""
        socket_dir = _socket_dir()
        socket = socket_dir / "endpoint.sock"
        endpoint = AgentEndpoint(model_name=model_name, unix_socket=socket)
        await endpoint.start()
        launch = ProgramLaunch.prepare(sandbox, hide=hide, socket=socket, environ=environ, limits=limits)
        return cls(endpoint, launch, socket_dir)

    async def stop(self) -> None:
        await self.endpoint.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _socket_dir() -> Path:
    """A directory for the agent endpoint's Unix socket: short (a socket path has 107 bytes at most) and
    outside the run directory, which sandboxes hide; a sandbox's nobody may reach it (the episodes' keys,
    not the socket's mode, decide who is served)."""
    folder = Path(tempfile.mkdtemp(prefix="rollart-agents-"))
    folder.chmod(0o755)
    return folder


@dataclass(frozen=True)
class AgentJob:
    """What an agent episode needs to run."""

    trajectory_id: str
    group_id: str
    task: TaskSpec
    seed: int
    sampling: SamplingSpec


async def run_agent_episode(job: AgentJob, context: EpisodeContext, host: AgentHost) -> Trajectory:
    """Play one episode of `job.task` with its agent program, served and started by `host`, and return it
    scored; raises `AgentFailed`."""
    task, program = job.task, job.task.agent
    endpoint, launch = host.endpoint, host.launch
    assert program is not None  # an agent task (checked with the topology)
    started_at, started_version = time.time(), None

    async def first_turn_starts(request: Generate) -> Generated:
        nonlocal started_version
        if started_version is None:
            started_version = context.policy_version()
            context.on_start(started_version)
        return await context.proxy.generate(task.name, request)

    episode = AgentEpisode(
        job.trajectory_id,
        task=task,
        sampling=job.sampling,
        renderer=context.renderer,
        generate=first_turn_starts,
        min_version=context.min_version,
    )
    access = endpoint.open(episode)
    reason = "the episode ended"
    try:
        argv, base_url = launch.argv(program, endpoint, job.trajectory_id)
        environ = {
            **launch.environ,
            **program.env,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": access.api_key,
            "ROLLART_EPISODE_ID": job.trajectory_id,
            "ROLLART_EPISODE_SEED": str(job.seed),
            "ROLLART_TASK": task.name,
        }
        code, stderr = await episode.history.timed("env", _run(argv, environ, program, launch.limits))
        if code != 0:
            raise AgentFailed(f"agent program of {job.trajectory_id} exited with {code}: {stderr[-STDERR_TAIL:]}")
        if not episode.turns:
            raise AgentFailed(f"agent program of {job.trajectory_id} made no call to its endpoint")
        report = episode.report
        if program.reward == "report":
            if report is None or report.reward is None:
                raise AgentFailed(f"agent program of {job.trajectory_id} ended without reporting a reward")
            reward = report.reward
        else:
            score_request = Score(
                fn=task.reward,
                task=task.name,
                prompt=context.renderer.decode(episode.prompt_ids or []),
                response="\n".join(episode.history.replies),
                answer=report.answer if report is not None else None,
                env_reward=0.0,
                tokens=len(episode.history.ids),
            )
            reward = await episode.history.timed("reward", context.score(score_request))
    except asyncio.CancelledError as exc:
        reason = str(exc.args[0]) if exc.args else "the episode was cancelled"
        raise
    except BaseException as exc:
        reason = f"the episode failed: {exc}"
        raise
    finally:
        endpoint.close(job.trajectory_id, reason)
        context.proxy.forget(job.trajectory_id)
    return Trajectory(
        trajectory_id=job.trajectory_id,
        group_id=job.group_id,
        task=task.name,
        seed=job.seed,
        prompt_ids=episode.prompt_ids or [],
        reward=reward,
        env_reward=report.reward if report is not None and report.reward is not None else 0.0,
        turns=episode.turns,
        finish="done",
        started_at_version=started_version if started_version is not None else context.policy_version(),
        started_at=started_at,
        finished_at=time.time(),
        success=bool(report is not None and report.success),
        **episode.history.record(),
    )


async def _run(
    argv: list[str], environ: Mapping[str, str], program: AgentProgram, limits: WorkerLimits
) -> tuple[int, str]:
    """Run the program to its end (killed past its timeout or when cancelled): its exit code and stderr."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=dict(environ),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group: killed whole, children included
        preexec_fn=lambda: set_limits(limits),
    )
    assert process.stderr is not None
    tail = bytearray()

    async def read_stderr() -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.read(4096):
            tail.extend(chunk)
            del tail[: max(0, len(tail) - 4 * STDERR_TAIL)]

    reader = asyncio.ensure_future(read_stderr())
    try:
        async with asyncio.timeout(program.timeout_s):
            code = await process.wait()
            await reader
    except TimeoutError:
        raise AgentFailed(f"agent program still running after its timeout_s ({program.timeout_s} s)") from None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        reader.cancel()
    return code, tail.decode(errors="replace")
