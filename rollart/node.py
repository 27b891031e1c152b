"""Entry point of one node: `python -m rollart.node --topology FILE --node NAME` (`bin/rollart-node`).

Parses the topology before anything heavy is imported, sets up JSON logging bound with the node
and its role, then runs the role's daemon on uvloop until it is drained (SIGTERM, SIGINT or
`POST /drain`). Exit codes: 0 drained cleanly; 2 bad configuration (message on stderr);
1 the node failed (the error is logged).

A configuration error, found when the topology loads or only when the node starts (a user module
that does not import), is written to stderr as `CONFIG_ERROR_MARK` + the message, which lands in the
node's log; `read_config_error` finds it there, so a launcher can print why the node exited 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import structlog

from rollart.cpus import check_from_env, pin_from_env
from rollart.errors import ConfigError
from rollart.generation.registry import backend as generation_backend
from rollart.topology import NodeSpec, Topology, load_topology
from rollart.topology.roles import Role
from rollart.workers.spawn import die_with_parent

EXIT_CONFIG = 2
THREAD_GRACE_S = 2.0
CONFIG_ERROR_MARK = "rollart-node: configuration error: "
"""Starts the stderr line of a configuration error (continued by lines of the message that follow)."""
LOG_TAIL_BYTES = 64 * 1024
LAUNCHER_PID_ENV = "ROLLART_LAUNCHER_PID"
"""Set by the local launcher for the nodes it starts: they stop when it dies."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollart-node", description="Run one node of a RollArt topology.")
    parser.add_argument("--topology", required=True, help="the topology YAML file")
    parser.add_argument("--node", required=True, help="the name of the node to run, as in the topology")
    parser.add_argument(
        "--exit-when-done",
        action="store_true",
        help="a trainer drains and exits 0 once its last step is checkpointed (how a Slurm job ends; "
        "other roles ignore it)",
    )
    return parser.parse_args(argv)


async def run_node(topology: Topology, name: str, *, exit_when_done: bool = False) -> None:
    """Build the node's daemon and run it until drained."""
    from rollart.nodes import TrainerNode, daemon_for

    spec = topology.node(name)
    secret = topology.read_secret()
    try:
        token: str | None = topology.read_admin_token()
    except ConfigError as exc:
        structlog.get_logger("rollart.node").warning("node.no_admin_token", detail=str(exc))
        token = None
    others = topology.other_secrets(spec)
    # Read once, then gone from the environment: no process the node starts (reward workers, env
    # workers, vLLM's engine) inherits them.
    for variable in topology.credential_variables():
        os.environ.pop(variable, None)
    daemon = daemon_for(spec)(topology, spec, secret=secret, admin_token=token, other_secrets=others)
    if exit_when_done and isinstance(daemon, TrainerNode):

        async def drain_when_done() -> None:
            await daemon.finished.wait()
            daemon.request_drain("the run is done (--exit-when-done)")

        watch = asyncio.ensure_future(drain_when_done())
        try:
            await daemon.run()
        finally:
            watch.cancel()
        return
    await daemon.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    if launcher.isdigit():
        # Started by `rollart run`: a launcher that is killed outright (SIGKILL, a test's timeout) cannot
        # stop its nodes, so each drains on its own then (SIGTERM), instead of running on as an orphan.
        die_with_parent(int(launcher), signal.SIGTERM)
    try:
        topology = load_topology(args.topology)
        spec = topology.node(args.node)
        if spec.role is Role.GENERATOR and generation_backend(topology.run.generator.backend).pins_after_start:
            check_from_env()  # it settles on its cores once its engine is up (rollart.cpus)
        else:
            pin_from_env()  # the launcher's share of the machine's cores, before any thread starts
        topology.read_secret()  # fail here, with the config error, not inside the loop
        topology.other_secrets(spec)
        check_visible_gpus(topology, spec)
    except ConfigError as exc:
        say_config_error(exc)
        return EXIT_CONFIG

    # Library progress bars (model loading and saving) would break the JSON lines of the node's log.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import uvloop

    from rollart.logs import configure_logging

    configure_logging(node=spec.name, role=spec.role.value, level=topology.run.log_level)
    log = structlog.get_logger("rollart.node")
    code = 0
    try:
        uvloop.run(run_node(topology, spec.name, exit_when_done=args.exit_when_done))
    except Exception as exc:  # the process is ending: log every cause, exit non-zero
        causes = _causes(exc)
        for cause in causes:
            log.error("node.failed", error=f"{type(cause).__name__}: {cause}", exc_info=cause)
        # A configuration problem found only when the node starts (a user module that does not
        # import) fails the same way on every restart: say so with the exit status, so launchers
        # and systemd (RestartPreventExitStatus=2) stop instead of restarting it.
        code = EXIT_CONFIG if all(isinstance(cause, ConfigError) for cause in causes) else 1
        if code == EXIT_CONFIG:
            for cause in causes:
                say_config_error(cause)
    _leave_stuck_threads(log, code)
    return code


def check_visible_gpus(topology: Topology, spec: NodeSpec) -> None:
    """A trainer or generator node given `resources.gpus: N` must see at least N CUDA devices (what the
    launcher's `CUDA_VISIBLE_DEVICES` or Slurm left it): otherwise it would train or generate on fewer, or
    on CPU, without a word. Only these nodes import torch anyway; a simulated generator uses none."""
    wanted = spec.resources.gpus
    if not wanted or spec.role not in (Role.TRAINER, Role.GENERATOR):
        return
    if spec.role is Role.GENERATOR and generation_backend(topology.run.generator.backend).simulated:
        return
    import torch

    seen = torch.cuda.device_count()
    if seen < wanted:
        index = topology.nodes.index(spec)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"{topology.source}: nodes[{index}].resources.gpus: node {spec.name} is given {wanted} GPU(s) but sees "
            f"{seen} (CUDA_VISIBLE_DEVICES={visible!r}, torch {torch.__version__}, CUDA {torch.version.cuda}): "
            "start it where its GPUs are, with a CUDA build of torch"
        )


def _causes(exc: BaseException) -> list[BaseException]:
    """What failed under `exc`: a task group's errors arrive wrapped once per task group they
    crossed (the node's, its role's), and the log should name the error itself."""
    if isinstance(exc, BaseExceptionGroup):
        return [cause for inner in exc.exceptions for cause in _causes(inner)]
    return [exc]


def say_config_error(exc: BaseException) -> None:
    print(f"{CONFIG_ERROR_MARK}{exc}", file=sys.stderr, flush=True)


def _log_tail(log: Path, offset: int) -> str | None:
    """The last `LOG_TAIL_BYTES` of a node's log after `offset` (where the log ended when the process started: an
    earlier run's lines are not this one's); None when it cannot be read."""
    try:
        with log.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(offset, size - LOG_TAIL_BYTES))
            return file.read().decode(errors="replace")
    except OSError:
        return None


_CHAINED = ("During handling", "The above exception")
"""Lines between two chained tracebacks."""


def read_last_error(log: Path, offset: int = 0) -> str | None:
    """The error that ended a node, from its log after `offset`: the causes its `node.failed` lines name,
    "; "-joined, or else the last line of the last Python traceback (a process that died before its logging was
    set up, or a library's own process); None if neither is there."""
    tail = _log_tail(log, offset)
    if tail is None:
        return None
    failed: list[str] = []
    traceback_end: str | None = None
    in_traceback = False
    for line in tail.splitlines():
        if line.startswith("{"):
            in_traceback = False
            try:
                record = json.loads(line)
            except ValueError:
                continue
            error = str(record.get("error") or "")  # a line that starts with "{" is an object
            if record.get("event") == "node.failed" and error and error not in failed:
                failed.append(error)
        elif line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line.strip() and not line.startswith((" ", "\t", *_CHAINED)):
            traceback_end = line.strip()  # the exception's line ends the traceback
            in_traceback = False
    return "; ".join(failed) or traceback_end


def read_config_error(log: Path, offset: int = 0) -> str | None:
    """The configuration errors a node wrote to its log after `offset` (where the log ended when the
    process started: an earlier run's errors are not this one's), "; "-joined; None if there are none."""
    tail = _log_tail(log, offset)
    if tail is None:
        return None
    messages: list[list[str]] = []
    open_message = False
    for line in tail.splitlines():
        if line.startswith(CONFIG_ERROR_MARK):
            messages.append([line.removeprefix(CONFIG_ERROR_MARK)])
            open_message = True
        elif open_message and line.strip() and not line.startswith("{"):  # a message of several lines
            messages[-1].append(line)
        else:  # a JSON log line, or a blank one, ends a message
            open_message = False
    return "; ".join("\n".join(lines) for lines in messages) or None


def _leave_stuck_threads(log: structlog.typing.FilteringBoundLogger, code: int) -> None:
    """Exit now if threads are still busy (an environment call stuck in a thread cannot be
    interrupted, and the interpreter would wait for it): a drained node must not hang."""
    deadline = time.monotonic() + THREAD_GRACE_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if stuck:
        log.warning("node.exit_leaving_threads", threads=stuck)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
