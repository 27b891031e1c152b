"""The run folder (`run.dir` in the topology): every file name in it, and its one JSON-lines format.

    RUN_DIR/
      metrics.jsonl        the trainer: a baseline line, then one line per training step
      timeline.jsonl       the trainer: one line per trained trajectory (spans, versions, incarnation)
      utilization.jsonl    the trainer: generator busy samples
      rollout.jsonl        rollout-only mode: every batch taken, one line per group
      tensorboard/         the trainer: its metrics lines as TensorBoard event files (`run.tracking`)
      wandb/               W&B's own folder, with `run.tracking.wandb` (offline runs to `wandb sync`)
      mlruns/              MLflow's file store, with `run.tracking.mlflow` and no tracking_uri
      checkpoints/
        step-NNNNNN/       the training engine's checkpoint (torch: a Hugging Face folder and the
                           optimizer state; fsdp2: config, tokenizer and `dcp/` shards) and `trainer.pt`
        latest             names the newest complete checkpoint (written last, atomically)
        incarnation        how many trainer processes of this run started before the current one
      logs/NODE.log        each node's log lines (the launchers write them)
      admin.token          the admin token `rollart run` made, when the topology names none
      job.sbatch           `rollart slurm`'s job script
      report/              `rollart report`: plots and report.md

Nothing else in `rollart/`, the tests or the benchmarks spells these names: they ask a `RunDir`.
What is inside a checkpoint folder (but `trainer.pt`) and inside `report/` is its writer's own (the
training engine's `save`, `rollart.report`); `rollart export` turns a checkpoint into a Hugging Face
model folder.
JSON lines are written one record per line, each `write` a single append, so a killed writer leaves
at most a cut last line, which `read_jsonl` drops (a bad line anywhere else is corruption and
raises). Imports no torch: the launcher and the report use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from rollart.errors import RollartError

CHECKPOINT_PREFIX = "step-"


class RunDirError(RollartError):
    """A file of the run folder is missing or corrupt."""


class _InRun:
    """A `RunDir` attribute that is a fixed path inside the run folder (`run.metrics`)."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    def __get__(self, run: RunDir, owner: type[RunDir]) -> Path:
        return run.path.joinpath(*self.parts)


class RunDir:
    """The layout of one run folder; creates nothing until a writer writes."""

    METRICS = "metrics.jsonl"
    TIMELINE = "timeline.jsonl"
    UTILIZATION = "utilization.jsonl"

    # The trainer's records.
    metrics = _InRun(METRICS)
    timeline = _InRun(TIMELINE)
    utilization = _InRun(UTILIZATION)
    rollout = _InRun("rollout.jsonl")
    """Rollout-only mode's record of the batches taken."""
    # The trackers' copies of the metrics (`rollart.tracking`).
    tensorboard = _InRun("tensorboard")
    wandb = _InRun("wandb")
    """W&B's folder: `wandb.init(dir=RUN_DIR)` makes it, one `offline-run-*` (or `run-*`) folder per start."""
    mlruns = _InRun("mlruns")
    # Checkpoints.
    checkpoints = _InRun("checkpoints")
    latest = _InRun("checkpoints", "latest")
    """The pointer file naming the newest complete checkpoint."""
    incarnation = _InRun("checkpoints", "incarnation")
    # What the launchers leave.
    admin_token = _InRun("admin.token")
    """The admin token `rollart run` made for the run it launched (mode 0600)."""
    sbatch = _InRun("job.sbatch")
    """`rollart sbatch`'s job script, by default."""
    logs = _InRun("logs")
    report = _InRun("report")
    """Where `rollart report` writes its plots and report.md by default."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint taken after `step`."""
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:06d}"

    def saved_checkpoints(self) -> list[Path]:
        """The checkpoint folders present, oldest first."""
        return sorted(p for p in self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())

    def latest_checkpoint(self) -> Path | None:
        """The folder `latest` names, or None when there is no pointer yet."""
        if not self.latest.exists():
            return None
        return self.checkpoints / self.latest.read_text().strip()

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None when there is none (or the pointer is
        unreadable)."""
        try:
            return int(self.latest.read_text().strip().removeprefix(CHECKPOINT_PREFIX))
        except (OSError, ValueError):
            return None

    def complete_checkpoint(self, step: int | None = None) -> Path:
        """The folder of the checkpoint after `step` (None: the one `latest` names), checked to be
        complete: its trainer state is written last, after the engine's part is whole. Raises
        `RunDirError` saying what is missing and which checkpoints there are."""
        steps = [p.name for p in self.saved_checkpoints() if self.trainer_state(p).exists()]
        there = f"complete ones here: {', '.join(steps)}" if steps else "none here is complete"
        if step is not None:
            path = self.checkpoint(step)
        else:
            latest = self.latest_checkpoint()
            if latest is None:
                raise RunDirError(f"no checkpoint in {self.path}: {self.latest} does not exist ({there})")
            path = latest
        if not path.is_dir():
            raise RunDirError(f"{path} does not exist ({there})")
        if not self.trainer_state(path).exists():
            raise RunDirError(
                f"{path} is half-written: {self.trainer_state(path).name} is missing (the run stopped while "
                f"saving it, or is saving it now; {there})"
            )
        return path

    def point_latest_at(self, checkpoint: Path) -> None:
        """Make `latest` name `checkpoint`, atomically (a kill mid-write leaves the old pointer)."""
        scratch = self.checkpoints / f".{self.latest.name}.tmp"
        scratch.write_text(checkpoint.name + "\n")
        scratch.replace(self.latest)

    def claim_incarnation(self) -> int:
        """Count up `incarnation` and return how many trainer processes of this run started before this one
        (0 for the first). Group ids carry it: a trainer that dies before its first checkpoint, or twice after
        the same one, would otherwise hand out the ids its last life did, and take a group still coming home
        from that life for a different one."""
        started = int(self.incarnation.read_text()) + 1 if self.incarnation.exists() else 0
        self.incarnation.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.incarnation.with_suffix(".tmp")
        scratch.write_text(f"{started}\n")
        scratch.replace(self.incarnation)
        return started

    @staticmethod
    def trainer_state(checkpoint: Path) -> Path:
        """The trainer's state in a checkpoint folder (version, step, RNG, dispenser)."""
        return checkpoint / "trainer.pt"

    def node_log(self, name: str) -> Path:
        """A node's log file (or another process's, e.g. `inprocess`)."""
        return self.logs / f"{name}.log"


class JsonlLog:
    """Append-only JSON lines, one write per batch of records (a killed run leaves at most a cut last line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, records: Iterable[Any]) -> None:
        data = b"".join(msgspec.json.encode(record) + b"\n" for record in records)
        if data:
            with self.path.open("ab") as out:
                out.write(data)


def read_jsonl(path: Path, *, lenient: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file. A last line that does not parse is a write cut short by a
    killed run and is dropped; a bad line anywhere else is corruption and raises `RunDirError`,
    unless `lenient`: a run killed mid-write and then resumed leaves its cut line in the middle, and
    a reader that checks such a run (the chaos harness) skips every line that does not parse."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if lenient or number == len(lines):
                continue
            raise RunDirError(f"{path}:{number}: not a JSON object ({exc.msg})") from exc
        if isinstance(value, dict):
            records.append(value)
    return records
