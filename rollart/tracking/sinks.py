"""The places a `Tracker` writes: TensorBoard event files, a W&B run, an MLflow run.

Each opens in its constructor and is called only from the tracker's one worker thread: these
libraries block (W&B starts its service process, MLflow writes files or calls a server), which the
trainer's event loop must not. Their packages are imported inside, so loading a topology imports
none of them.
"""

from __future__ import annotations

import functools
import os
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from rollart.tracking.config import MlflowSpec, WandbSpec

MLFLOW_BATCH = 1000
"""Most metrics in one MLflow `log_batch` call (MLflow's own limit)."""


class Sink(Protocol):
    """One tracker's open run: scalars by tag at a step, then closed once."""

    def starts_at(self, step: int) -> None:
        """This life of the trainer logs steps from `step` on (before its first line)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in `folder`, by torch's `SummaryWriter` (its own thread writes them).

    One folder holds every life of a run: a trainer resumed from a checkpoint logs again the steps its
    last life logged after that checkpoint. `starts_at` opens the writer with that step as its
    `purge_step`, and TensorBoard then drops what the folder's earlier event files hold at that step
    and after, rather than showing two values at each of those steps."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # here: a missing package fails at the start

        self._open = functools.partial(SummaryWriter, log_dir=str(folder))
        self._writer: SummaryWriter | None = None

    def starts_at(self, step: int) -> None:
        if self._writer is None:
            self._writer = self._open(purge_step=step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            self._writer = self._open()
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        # One flush per line (a line per training step): a killed trainer's event files hold as
        # many steps as its metrics.jsonl, not those of the last two minutes less.
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbSink:
    """A W&B run whose files go to `parent`/wandb (`RunDir.wandb` when `parent` is the run folder)."""

    def __init__(self, spec: WandbSpec, *, parent: Path, name: str) -> None:
        import wandb

        parent.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            mode=spec.mode,
            name=spec.name or name,
            tags=spec.tags or None,
            dir=parent,
            # console off: W&B would otherwise capture the node's stdout and stderr, its log.
            settings=wandb.Settings(console="off", silent=True),
        )

    def starts_at(self, step: int) -> None:
        pass  # each life of the trainer is a W&B run of its own

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run, through an `MlflowClient` of its own (no global active run to share)."""

    def __init__(self, spec: MlflowSpec, *, uri: str, name: str) -> None:
        from mlflow.tracking import MlflowClient

        if urllib.parse.urlparse(uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless told it may use it; it is the only store that
            # needs no server and no database driver (mlflow-skinny has no SQLAlchemy). A value the
            # environment already gives wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(spec.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self._client.create_experiment(spec.experiment)
        self._run_id = self._client.create_run(experiment_id, run_name=spec.run_name or name).info.run_id

    def starts_at(self, step: int) -> None:
        pass  # each life of the trainer is an MLflow run of its own

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(tag, value, now_ms, step) for tag, value in scalars.items()]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[start : start + MLFLOW_BATCH])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)
