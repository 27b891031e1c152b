"""Experiment tracking (`run.tracking`, `rollart.tracking`): metrics lines in, read back with each library's reader.

Every test names the tracker it is about (tensorboard, wandb, mlflow), so `pytest -k tensorboard`
picks the TensorBoard ones. TensorBoard's event files are read with TensorBoard's own
`EventAccumulator`, MLflow's runs with `MlflowClient`, and an offline W&B run from its `.wandb` file.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from google.protobuf.message import DecodeError
from structlog.testing import capture_logs

from rollart.errors import ConfigError
from rollart.protocol.messages import GroupDone, Trajectory
from rollart.rundir import RunDir, read_jsonl
from rollart.topology import load_topology, parse_topology
from rollart.tracking import MlflowSpec, Tracker, TrackingSpec, WandbSpec, step_scalars
from rollart.tracking.records import StepRecords
from rollart.tracking.sinks import TensorBoardSink

ROOT = Path(__file__).resolve().parents[2]

BASELINE = {"baseline": True, "tasks": {"frozen_lake": {"success_rate": 0.01, "reward_mean": 0.02}}}


def step_line(step: int) -> dict[str, Any]:
    """A metrics line shaped like the learner's: nested per-task and per-generator numbers, and
    things that are no scalar (a bool, a string, a list)."""
    return {
        "step": step,
        "elapsed_s": 1.5 * step,
        "version": step,
        "reward_mean": 0.25 * step,
        "tasks": {"frozen_lake": {"reward_mean": 0.1 * step, "count": 8}},
        "generator_busy": {"gen-0": 0.5},
        "weight_link_bytes": 4096 * step,
        "resumed": False,
        "note": "not a number",
        "betas": [0.9, 0.999],
    }


TAGS = {
    "elapsed_s",
    "version",
    "reward_mean",
    "tasks/frozen_lake/reward_mean",
    "tasks/frozen_lake/count",
    "generator_busy/gen-0",
    "weight_link_bytes",
}
BASELINE_TAGS = {"baseline/tasks/frozen_lake/success_rate", "baseline/tasks/frozen_lake/reward_mean"}


def feed(tracker: Tracker, steps: int = 3) -> None:
    tracker.log(BASELINE)
    for step in range(1, steps + 1):
        tracker.log(step_line(step))
    tracker.log({"no": "step"})  # neither a step nor the baseline: not tracked
    tracker.close()


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `folder`, by tag: (step, value), as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# -- what a line's scalars are ------------------------------------------------------------------------


def test_tensorboard_gets_the_lines_numbers_flattened_by_step_and_the_baseline_at_step_0(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    feed(Tracker.from_spec(TrackingSpec(), run))
    scalars = tensorboard_scalars(run.tensorboard)
    assert set(scalars) == TAGS | BASELINE_TAGS
    assert scalars["baseline/tasks/frozen_lake/success_rate"] == [(0, pytest.approx(0.01))]
    assert scalars["reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert scalars["tasks/frozen_lake/reward_mean"] == [(s, pytest.approx(0.1 * s)) for s in (1, 2, 3)]
    assert scalars["weight_link_bytes"] == [(s, 4096.0 * s) for s in (1, 2, 3)]
    assert step_scalars({"step": True, "x": 1}) is None  # a bool is no step


def test_a_resumed_trainers_steps_replace_in_tensorboard_what_its_last_life_logged_after_the_checkpoint(
    tmp_path: Path,
) -> None:
    run = RunDir(tmp_path / "run")
    first = Tracker.from_spec(TrackingSpec(), run)
    first.starts_at(0)
    feed(first, steps=5)  # checkpointed after step 3, then killed after step 5
    time.sleep(1.1)  # TensorBoard reads event files in name order, which begins with the second each opened
    second = Tracker.from_spec(TrackingSpec(), run)
    second.starts_at(4)
    for step in (4, 5, 6):
        second.log(step_line(step) | {"reward_mean": 10.0 * step})
    second.close()
    scalars = tensorboard_scalars(run.tensorboard)
    assert scalars["reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert scalars["baseline/tasks/frozen_lake/success_rate"] == [(0, pytest.approx(0.01))]
    # A life that starts again from no checkpoint logs from 0: the earlier lives' steps are gone.
    time.sleep(1.1)
    third = Tracker.from_spec(TrackingSpec(), run)
    third.starts_at(0)
    feed(third, steps=1)
    assert tensorboard_scalars(run.tensorboard)["reward_mean"] == [(1, 0.25)]


def test_tensorboard_dir_is_relative_to_the_run_folder_and_off_writes_nothing(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    feed(Tracker.from_spec(TrackingSpec(dir="tb"), run))
    assert set(tensorboard_scalars(run.path / "tb")) == TAGS | BASELINE_TAGS
    off = RunDir(tmp_path / "off")
    feed(Tracker.from_spec(TrackingSpec(tensorboard=False), off))
    assert not off.path.exists()


# -- W&B ------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B's settings, cache and default folders under tmp_path, offline, and no key of the machine's."""
    home = tmp_path / "wandb-home"
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")  # its service process starts slowly on a loaded machine
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return home


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a `.wandb` file: a 7-byte header (":W&B", magic, version), then
    LevelDB's log format (32 KiB blocks of chunks, each: CRC-32C, length, type; type 1 a whole
    record, 2 to 4 its first, middle and last parts). W&B's SDK no longer ships a reader."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pieces = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def written_records(path: Path, timeout_s: float = 60.0) -> list[Any]:
    """The records of a `.wandb` file once its writer has written the run's `exit` record. W&B's
    service process writes the file through a buffer and may close it after `finish()` has returned
    (CI once read it on a loaded machine with no `run` record in it yet, 2026-12-03)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(wandb_records(path))
        except DecodeError:  # a record cut off where the writer has not reached yet
            records = []
        kinds = [record.WhichOneof("record_type") for record in records]
        if "exit" in kinds:
            return records
        assert time.monotonic() < deadline, f"no exit record in {path} after {timeout_s} s: {kinds}"
        time.sleep(0.5)


def test_wandb_offline_run_in_the_run_folder_holds_each_step(tmp_path: Path, wandb_home: Path) -> None:
    run = RunDir(tmp_path / "run")
    spec = TrackingSpec(tensorboard=False, wandb=WandbSpec(project="rollart-test", tags=["unit"]))
    with capture_logs() as logs:
        feed(Tracker.from_spec(spec, run))
    assert not logs, logs  # a sink that failed says why here (it failed once in a full unit run, 2026-12-02)
    [offline] = list(run.wandb.glob("offline-run-*"))
    [file] = list(offline.glob("run-*.wandb"))
    records = written_records(file)
    history: dict[int, dict[str, float]] = {}
    names = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items.pop("_step")] = {tag: value for tag, value in items.items() if not tag.startswith("_")}
        elif record.WhichOneof("record_type") == "run":
            names.append((record.run.display_name, list(record.run.tags), record.run.project))
    assert names[0] == ("run", ["unit"], "rollart-test")  # named after the run folder
    assert sorted(history) == [0, 1, 2, 3]
    assert set(history[0]) == BASELINE_TAGS
    assert all(set(history[step]) == TAGS for step in (1, 2, 3))
    assert [history[step]["reward_mean"] for step in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert history[2]["generator_busy/gen-0"] == 0.5


def test_wandb_or_mlflow_configured_but_not_installed_is_a_config_error_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunDir(tmp_path / "run")
    for package, spec in [
        ("wandb", TrackingSpec(wandb=WandbSpec(project="p"))),
        ("mlflow", TrackingSpec(mlflow=MlflowSpec(experiment="e"))),
    ]:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, package, None)  # what an environment without it looks like to find_spec
            with pytest.raises(ConfigError) as caught:
                Tracker.from_spec(spec, run)
        expected = f"run.tracking.{package}: configured, but the {package} package is not installed here"
        assert str(caught.value) == f"{expected}: pip install 'rollart[tracking]'"


# -- MLflow ---------------------------------------------------------------------------------------


def test_mlflow_file_store_in_the_run_folder_holds_each_metrics_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    # The sink itself allows MLflow's file store; set and then removed here so that teardown undoes it.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "placeholder")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    run = RunDir(tmp_path / "run")
    feed(Tracker.from_spec(TrackingSpec(tensorboard=False, mlflow=MlflowSpec(experiment="lake")), run))
    assert run.mlruns.is_dir()
    client = MlflowClient(tracking_uri=run.mlruns.resolve().as_uri())
    experiment = client.get_experiment_by_name("lake")
    assert experiment is not None
    [found] = client.search_runs([experiment.experiment_id])
    assert (found.info.run_name, found.info.status) == ("run", "FINISHED")
    assert set(found.data.metrics) == TAGS | BASELINE_TAGS

    def history(tag: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, tag))

    assert history("reward_mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history("tasks/frozen_lake/count") == [(1, 8.0), (2, 8.0), (3, 8.0)]
    assert history("baseline/tasks/frozen_lake/reward_mean") == [(0, 0.02)]


# -- a sink that fails ----------------------------------------------------------------------------


class RaisesOnSecondLine:
    """A sink whose library breaks mid-run, as W&B's would when its service process dies."""

    def __init__(self) -> None:
        self.lines = 0
        self.closed = False

    def starts_at(self, step: int) -> None:
        pass

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.lines += 1
        if self.lines == 2:
            raise RuntimeError("wandb service process died")

    def close(self) -> None:
        self.closed = True


def cannot_open() -> RaisesOnSecondLine:
    raise ConnectionError("mlflow server at http://mlflow:5000 refused the connection")


def test_a_failing_wandb_or_mlflow_sink_is_dropped_with_one_warning_and_tensorboard_keeps_logging(
    tmp_path: Path,
) -> None:
    run = RunDir(tmp_path / "run")
    wandb = RaisesOnSecondLine()
    with capture_logs() as logs:
        tracker = Tracker(
            {
                "mlflow": cannot_open,
                "wandb": lambda: wandb,
                "tensorboard": functools.partial(TensorBoardSink, run.tensorboard),
            }
        )
        feed(tracker, steps=4)
    warnings = [(e["sink"], e["failed_to"], e["error"]) for e in logs if e["event"] == "tracking.sink_disabled"]
    assert warnings == [
        ("mlflow", "open", "ConnectionError: mlflow server at http://mlflow:5000 refused the connection"),
        ("wandb", "log", "RuntimeError: wandb service process died"),
    ]
    assert all(e["log_level"] == "warning" for e in logs if e["event"] == "tracking.sink_disabled")
    assert (wandb.lines, wandb.closed) == (2, False)  # no line after it raised, and not closed
    assert [step for step, _ in tensorboard_scalars(run.tensorboard)["reward_mean"]] == [1, 2, 3, 4]
    tracker.close()  # a second close does nothing
    tracker.log(step_line(5))  # nor does a line after it (a step that ended while the trainer drained)


# -- the topology's run.tracking ------------------------------------------------------------------

NODES = [{"name": "trainer", "role": "trainer", "port": 7100, "admin_port": 7200}]


def with_tracking(tracking: Any) -> str:
    return yaml.safe_dump({"run": {"tracking": tracking}, "nodes": NODES})


def test_run_tracking_defaults_to_tensorboard_in_the_run_folder_for_every_topology() -> None:
    assert parse_topology(yaml.safe_dump({"nodes": NODES})).run.tracking == TrackingSpec(
        tensorboard=True, dir=None, wandb=None, mlflow=None
    )
    assert load_topology(ROOT / "configs" / "local.yaml").run.tracking.tensorboard  # the default run writes events
    assert RunDir("runs/local").tensorboard == Path("runs/local/tensorboard")


def test_run_tracking_with_tensorboard_wandb_and_mlflow_blocks_parses() -> None:
    tracking = {
        "tensorboard": False,
        "dir": "/shared/tb",
        "wandb": {"project": "lake", "entity": "team", "mode": "online", "tags": ["grpo"]},
        "mlflow": {"experiment": "lake", "tracking_uri": "http://mlflow:5000", "run_name": "first"},
    }
    parsed = parse_topology(with_tracking(tracking)).run.tracking
    assert msgspec.to_builtins(parsed) == {**tracking, "wandb": {**tracking["wandb"], "name": None}}


@pytest.mark.parametrize(
    ("tracking", "expected"),
    [
        pytest.param(
            {"tensorbord": True}, "run.tracking: unknown key 'tensorbord'; did you mean 'tensorboard'?", id="key"
        ),
        pytest.param({"tensorboard": 1}, "run.tracking.tensorboard: expected bool; got int", id="tensorboard-type"),
        pytest.param(
            {"wandb": {"projet": "x"}},
            "run.tracking.wandb: unknown key 'projet'; did you mean 'project'?",
            id="wandb-key",
        ),
        pytest.param({"wandb": {}}, "run.tracking.wandb: missing required key 'project'", id="wandb-project"),
        pytest.param(
            {"wandb": {"project": "x", "mode": "sometimes"}},
            "run.tracking.wandb.mode: expected one of offline, online, disabled; got 'sometimes'",
            id="wandb-mode",
        ),
        pytest.param(
            {"mlflow": {"experiment": ""}},
            "run.tracking.mlflow.experiment: expected a non-empty string; got ''",
            id="mlflow-empty",
        ),
        pytest.param(
            {"mlflow": {"experiment": "x", "tracking_url": "http://h"}},
            "run.tracking.mlflow: unknown key 'tracking_url'; did you mean 'tracking_uri'?",
            id="mlflow-key",
        ),
    ],
)
def test_tensorboard_wandb_and_mlflow_config_errors_name_their_yaml_path(tracking: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_topology(with_tracking(tracking), "t.yaml")
    assert str(caught.value) == f"t.yaml: {expected}"


# -- the step records feed their metrics lines to the tracker -------------------------------------------


def group(step: int) -> GroupDone:
    def trajectory(i: int) -> Trajectory:
        return Trajectory(
            trajectory_id=f"{step}.{i}",
            group_id=str(step),
            task="frozen_lake",
            seed=step,
            prompt_ids=[1],
            response_ids=[2],
            response_mask=[1],
            logprobs=[-0.5],
            versions=[step - 1],
            reward=float(i % 2),
            env_reward=float(i % 2),
            turns=1,
            finish="done",
            started_at_version=step - 1,
            started_at=0.0,
            finished_at=1.0,
            env_wait_s=0.0,
            gen_wait_s=0.0,
            success=i % 2 == 1,
        )

    return GroupDone(str(step), [trajectory(i) for i in range(4)])


def test_the_step_records_write_metrics_jsonl_as_before_and_the_same_numbers_to_tensorboard(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    records = StepRecords(run, peer_status={}, tracking=TrackingSpec())
    for step in (1, 2):
        batch = [group(step)] if step == 1 else [msgspec.structs.replace(group(step), cut=1)]  # one short group
        records.step(step, step, batch, {"loss": 0.5 / step}, weights={"stall_s": 0.0}, incarnation=0)
    records.close()
    lines = read_jsonl(run.metrics)
    assert [line["step"] for line in lines] == [1, 2]
    assert "groups_cut" not in lines[0] and lines[1]["groups_cut"] == 1
    scalars = tensorboard_scalars(run.tensorboard)
    assert scalars["loss"] == [(line["step"], pytest.approx(line["loss"])) for line in lines]
    success_ma = [(line["step"], pytest.approx(line["tasks"]["frozen_lake"]["success_ma"])) for line in lines]
    assert scalars["tasks/frozen_lake/success_ma"] == success_ma
