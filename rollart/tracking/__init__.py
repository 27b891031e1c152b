"""Experiment tracking (`run.tracking`): the trainer's metrics lines, also in TensorBoard, W&B and MLflow.

`metrics.jsonl` stays the run's record (the report and the tests read it); a `Tracker` copies each
line to the trackers the topology names, as scalars by step. `config.py` holds the `run.tracking`
spec (the topology imports it: nothing heavy), `tracker.py` the tracker and what a line's scalars
are, `sinks.py` one class per tracker library. TensorBoard is on by default (event files in
`RunDir.tensorboard`: `tensorboard --logdir RUN_DIR`); W&B and MLflow are the `tracking` extra.
"""

from rollart.tracking.config import MlflowSpec, TrackingSpec, WandbSpec
from rollart.tracking.tracker import Tracker, flatten, step_scalars

__all__ = ["MlflowSpec", "Tracker", "TrackingSpec", "WandbSpec", "flatten", "step_scalars"]
