"""`Tracker`: each metrics line the learner writes, also as scalars to TensorBoard, W&B and MLflow.

A line's numbers are flattened into tags joined by "/" (`tasks/frozen_lake/success_rate`,
`generator_busy/gen-0`); bools, strings and lists are left out. The x-axis is the line's `step`.
The baseline line (`{"baseline": true, "tasks": ...}`, the random policy measured before step 1)
is step 0, its tags under `baseline/` (`baseline/tasks/frozen_lake/success_rate`); a held-out
evaluation's line (`{"eval": true, "step": S, ...}`) is at step S, its tags under `eval/`; a line with
none of these is not tracked.

Every call into a tracker library happens on one worker thread, in order: opening the sinks (at
construction), each line, closing them. `log` only hands a line over, so the trainer's event loop
never waits on a library. A sink that raises is logged once (`tracking.sink_disabled`) and
dropped: training and the other sinks go on.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from rollart.errors import ConfigError
from rollart.rundir import RunDir
from rollart.tracking.config import TrackingSpec
from rollart.tracking.sinks import MlflowSink, Sink, TensorBoardSink, WandbSink

log = structlog.get_logger("rollart.tracking")

EXTRA = "pip install 'rollart[tracking]'"


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of `record` by tag, nested mappings joined with "/"; anything else is left out."""
    scalars: dict[str, float] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            scalars |= flatten(value, f"{tag}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            scalars[tag] = float(value)
    return scalars


def step_scalars(line: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """A metrics line's step and its scalars by tag (see the module's docstring); None: not tracked."""
    if line.get("baseline") is True:
        return 0, flatten({key: value for key, value in line.items() if key != "baseline"}, "baseline/")
    step = line.get("step")
    if line.get("eval") is True and isinstance(step, int):  # a held-out evaluation after `step` steps
        return step, flatten({key: value for key, value in line.items() if key not in ("eval", "step")}, "eval/")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return step, flatten({key: value for key, value in line.items() if key != "step"})


class Tracker:
    """Sends metrics lines to the sinks it opens, from one worker thread; `close` once at the end."""

    def __init__(self, sinks: Mapping[str, Callable[[], Sink]]) -> None:
        """`sinks`: a name for each sink (in warnings) and what opens it (called on the worker thread)."""
        self.names = list(sinks)
        """The sinks configured (not all of them may still be open)."""
        self._open: dict[str, Sink] = {}  # touched by the worker thread only
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollart-tracking")
        self._closed = False
        self._closing = threading.Lock()  # `close` runs on another thread than `log`
        if self.names:
            self._submit(self._open_all, dict(sinks))

    @classmethod
    def from_spec(cls, spec: TrackingSpec, run_dir: RunDir) -> Tracker:
        """The trackers `spec` (`run.tracking`) names, writing into `run_dir`; raises `ConfigError`
        when one is configured but its package is not installed here."""
        name = run_dir.path.resolve().name
        sinks: dict[str, Callable[[], Sink]] = {}
        if spec.tensorboard:
            _require(
                "tensorboard", "run.tracking.tensorboard", "reinstall RollArt (tensorboard is one of its dependencies)"
            )
            folder = run_dir.tensorboard if spec.dir is None else run_dir.path / spec.dir
            sinks["tensorboard"] = functools.partial(TensorBoardSink, folder)
        if spec.wandb is not None:
            _require("wandb", "run.tracking.wandb", EXTRA)
            sinks["wandb"] = functools.partial(WandbSink, spec.wandb, parent=run_dir.wandb.parent, name=name)
        if spec.mlflow is not None:
            _require("mlflow", "run.tracking.mlflow", EXTRA)
            uri = spec.mlflow.tracking_uri or run_dir.mlruns.resolve().as_uri()
            sinks["mlflow"] = functools.partial(MlflowSink, spec.mlflow, uri=uri, name=name)
        return cls(sinks)

    def starts_at(self, step: int) -> None:
        """Say, before the first line, the step this life of the trainer logs from (0 for a new run, one
        past the checkpoint's step for a resumed one): a tracker that keeps one history across lives
        (TensorBoard's folder) drops what an earlier life logged from that step on."""
        with self._closing:
            if self.names and not self._closed:
                self._submit(self._starts_at, step)

    def log(self, line: Mapping[str, Any]) -> None:
        """Hand a metrics line to the sinks; returns at once (the worker thread writes it). A line
        after `close` (a step that ended while the trainer drained) is left to metrics.jsonl."""
        point = step_scalars(line)
        with self._closing:
            if point is not None and self.names and not self._closed:
                self._submit(self._write, *point)

    def close(self) -> None:
        """Flush and end every sink's run, waiting for the lines handed over before; blocks (call it
        from a worker thread on an event loop). A second call does nothing."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            if self.names:
                self._submit(self._close_all)
        self._pool.shutdown(wait=True)

    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        # In the caller's context: the worker's log lines carry the node and role it was bound with.
        done = self._pool.submit(contextvars.copy_context().run, work, *args)
        done.add_done_callback(_say_if_failed)

    def _open_all(self, sinks: dict[str, Callable[[], Sink]]) -> None:
        for name, open_sink in sinks.items():
            try:
                self._open[name] = open_sink()
            except Exception as exc:  # any library error: that sink is off, training goes on
                self._disable(name, "open", exc)

    def _starts_at(self, step: int) -> None:
        self._each("open", lambda sink: sink.starts_at(step))

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        self._each("log", lambda sink: sink.log(step, scalars))

    def _each(self, doing: str, call: Callable[[Sink], None]) -> None:
        for name, sink in list(self._open.items()):
            try:
                call(sink)
            except Exception as exc:  # any library error: that sink is off, training goes on
                self._disable(name, doing, exc)

    def _close_all(self) -> None:
        for name, sink in list(self._open.items()):
            try:
                sink.close()
            except Exception as exc:  # its last lines may be lost; the other sinks still close
                self._disable(name, "close", exc)
        self._open.clear()

    def _disable(self, name: str, doing: str, exc: Exception) -> None:
        self._open.pop(name, None)
        log.warning("tracking.sink_disabled", sink=name, failed_to=doing, error=f"{type(exc).__name__}: {exc}")


def _require(package: str, at: str, remedy: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{at}: configured, but the {package} package is not installed here: {remedy}")


def _say_if_failed(done: Future[None]) -> None:
    """Log a worker call that raised past its own handling (a bug here, not a sink's failure)."""
    if not done.cancelled() and (error := done.exception()) is not None:
        log.error("tracking.failed", error=f"{type(error).__name__}: {error}")
