"""`run.tracking`: where the trainer sends each metrics line besides `metrics.jsonl`.

    run:
      tracking:
        tensorboard: true                 # the default: event files in RUN_DIR/tensorboard
        wandb: {project: lake, mode: offline, tags: [grpo]}
        mlflow: {experiment: lake}        # a file store in RUN_DIR/mlruns unless tracking_uri says

TensorBoard ships with RollArt; W&B and MLflow are the `tracking` extra
(`pip install 'rollart[tracking]'`). Imports nothing heavy: the topology loads it.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class WandbSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A Weights & Biases run for each start of the trainer, in W&B's folder of the run folder."""

    project: str
    """The W&B project."""
    entity: str | None = None
    """The W&B team or user; None: the logged-in user's default."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline: written to the run folder only (`wandb sync` uploads it later); online: streamed to
    the W&B server (needs a login and the network); disabled: W&B's no-op run."""
    name: str | None = None
    """The W&B run's display name; None: the run folder's name."""
    tags: list[str] = []
    """Tags of the W&B run."""


class MlflowSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """An MLflow run for each start of the trainer."""

    experiment: str
    """The MLflow experiment, created when it does not exist."""
    tracking_uri: str | None = None
    """Where MLflow keeps runs (`http://host:5000`, `file:/path`, ...); None: a file store in the
    run folder (`RunDir.mlruns`)."""
    run_name: str | None = None
    """The MLflow run's name; None: the run folder's name."""


class TrackingSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Experiment trackers fed each metrics line (`rollart.tracking.Tracker`)."""

    tensorboard: bool = True
    """Write TensorBoard event files (torch's `SummaryWriter`)."""
    dir: str | None = None
    """Folder of the TensorBoard event files, relative to the run folder (or absolute); None:
    `RunDir.tensorboard`."""
    wandb: WandbSpec | None = None
    """Also log to Weights & Biases; None: not."""
    mlflow: MlflowSpec | None = None
    """Also log to MLflow; None: not."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) for each value msgspec's types let through but a tracker would refuse."""
        given: list[tuple[str, str | None]] = [("dir", self.dir)]
        if self.wandb is not None:
            given += [("wandb.project", self.wandb.project), ("wandb.entity", self.wandb.entity)]
            given += [("wandb.name", self.wandb.name)]
            given += [(f"wandb.tags[{i}]", tag) for i, tag in enumerate(self.wandb.tags)]
        if self.mlflow is not None:
            given += [("mlflow.experiment", self.mlflow.experiment), ("mlflow.tracking_uri", self.mlflow.tracking_uri)]
            given += [("mlflow.run_name", self.mlflow.run_name)]
        blank = [(field, value) for field, value in given if value is not None and not value.strip()]
        return [(field, f"expected a non-empty string; got {value!r}") for field, value in blank]
