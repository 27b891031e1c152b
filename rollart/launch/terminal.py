"""What `rollart run` shows on the terminal: the live status block, its messages and the summary.

The launcher (rollart/launch/local.py) supervises the node processes and feeds their states to a
`Terminal`; this module only draws. On a TTY the status block (header, the trainer's progress bar,
one line per node) is redrawn in place every poll, and a message clears it first so it scrolls
above; without a TTY (a pipe, a log file, a test) the block is printed every `NON_TTY_EVERY_S`
seconds and at the end, and messages are plain lines.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rollart import step_times
from rollart.node import EXIT_CONFIG, read_last_error

if TYPE_CHECKING:
    from rollart.launch.local import NodeProcess

NON_TTY_EVERY_S = 5.0  # without a terminal, print the status block this often


def describe_exit(code: int) -> str:
    """A process's exit status in words: "exited with code 2", "was killed by SIGKILL"."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def describe_end(name: str, code: int, log: Path, offset: int = 0) -> str:
    """One line for a node process that ended: how, the error that ended it when it failed (the last one its
    log shows after `offset`: `rollart.node.read_last_error`), and where its log is."""
    error = read_last_error(log, offset) if code not in (0, EXIT_CONFIG) else None
    return f"node {name} {describe_exit(code)}" + (f": {error}" if error else "") + f" (log: {log})"


class Terminal:
    """Draws one run's status block and messages to `out`."""

    def __init__(self, out: TextIO, run_name: str) -> None:
        self.out = out
        self.run_name = run_name
        self.tty = out.isatty()
        self._started_at = time.monotonic()
        self._lines_drawn = 0
        self._last_print = -NON_TTY_EVERY_S
        self._baseline_said = False

    def say(self, text: str) -> None:
        """A message line (above the status block, which is redrawn at the next poll)."""
        if self.tty and self._lines_drawn:
            self.out.write(f"\x1b[{self._lines_drawn}F\x1b[J")
            self._lines_drawn = 0
        self.out.write(text + "\n")
        self.out.flush()

    def render(self, nodes: Sequence[NodeProcess], *, final: bool = False) -> None:
        """The status block: redrawn in place on a TTY, else printed now and then (and at the end)."""
        lines = [*self._training_bar(nodes), *(self._line(node) for node in nodes)]
        elapsed = time.monotonic() - self._started_at
        header = f"[{elapsed:6.1f}s] {self.run_name}: " + ("stopped" if final else "Ctrl-C drains and stops every node")
        if self.tty:
            if self._lines_drawn:
                self.out.write(f"\x1b[{self._lines_drawn}F\x1b[J")
            self.out.write("\n".join([header, *lines]) + "\n")
            self._lines_drawn = len(lines) + 1
        elif final or elapsed - self._last_print >= NON_TTY_EVERY_S:
            self._last_print = elapsed
            self.out.write("\n".join([header, *lines]) + "\n")
        self.out.flush()

    def summary(self, failure: str | None, unclean: Sequence[NodeProcess], total: int) -> None:
        """The run's last lines: why it failed, which nodes ended badly, or that all stopped cleanly."""
        if failure:
            self.say(f"run failed: {failure}")
            return
        for node in unclean:
            self.say(f"node {node.spec.name} {describe_exit(node.exit_code or 0)} (log: {node.log_path})")
        if not unclean:
            self.say(f"all {total} nodes stopped cleanly")

    def _training_bar(self, nodes: Sequence[NodeProcess]) -> list[str]:
        """The trainer's progress bar (step, rewards, staleness, throughput, generator busy)."""
        for node in nodes:
            training = (node.status or {}).get("training")
            rollout = (node.status or {}).get("rollout") or {}
            if not training:
                continue
            if training.get("baseline") and not self._baseline_said:
                self._baseline_said = True
                parts = [
                    f"{task} success {b['success_rate']:.3f} reward {b['reward_mean']:.3f}"
                    for task, b in training["baseline"].items()
                ]
                self.say("random-policy baseline (uniformly random valid actions): " + "; ".join(parts))
            from tqdm import tqdm

            steps, elapsed = rollout.get("steps"), time.monotonic() - self._started_at
            # total None (no step limit) draws a counter instead of a bar; the stubs only allow floats.
            bar = tqdm.format_meter(rollout.get("batches", 0), steps, elapsed, ncols=60, prefix="  training")  # type: ignore[arg-type]
            return [bar, f"  {training_line(rollout, training.get('last_step') or {})}"]
        return []

    @staticmethod
    def _line(node: NodeProcess) -> str:
        status = node.status or {}
        sessions = status.get("sessions", {})
        all_sessions = sessions.get("outgoing", []) + sessions.get("incoming", [])
        up = sum(1 for s in all_sessions if s.get("state") == "up")
        queues = ",".join(f"{k}={v}" for k, v in status.get("queues", {}).items()) or "-"
        pid = node.proc.pid if node.proc else "-"
        uptime = f"{status['uptime_s']:.0f}s" if "uptime_s" in status else "-"
        progress = f"  {status['progress']}" if status.get("progress") else ""
        return (
            f"  {node.spec.name:<16} {node.spec.role.value:<15} {node.state:<22} pid {pid!s:<7} up {uptime:<6} "
            f"sessions {up}/{len(all_sessions)} up  queues {queues}  restarts {len(node.restarts)}{progress}"
        )


def training_line(rollout: dict[str, Any], last: dict[str, Any]) -> str:
    """The trainer's line under the bar, from its `/status`: each task's moving averages, staleness, the mismatch
    monitor's KL, throughput and how busy each generator was, for the newest step."""
    steps = rollout.get("steps") if rollout.get("steps") is not None else "-"
    where = f"step {rollout.get('batches', 0)}/{steps}"
    if not last:
        return f"{where}, version {rollout.get('version', 0)}: waiting for the first batch"
    tasks = " ".join(
        f"{name} reward {t['reward_ma']:.2f} success {t['success_ma']:.2f}" for name, t in last["tasks"].items()
    )
    busy = " ".join(f"{name} {value:.0%}" for name, value in last["generator_busy"].items()) or "-"
    # generator vs trainer on tokens of the trainer's own version (docs/training.md: the mismatch monitor)
    mismatch = f"mismatch KL {kl:.1e} | " if (kl := last.get("mismatch_kl")) is not None else ""
    return (
        f"{where} | {tasks} (20-step avg) | stale {last.get('staleness_mean', 0.0):.2f} | {mismatch}"
        f"{last['traj_per_s']:.1f} traj/s | busy {busy} | step: {step_times.describe(last)}"
    )
