"""The run folder's layout and its JSON-lines format (`rollart.rundir`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollart.rundir import JsonlLog, RunDir, RunDirError, read_jsonl


def test_every_file_has_its_place_under_the_run_folder(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    assert run.metrics == tmp_path / "run" / "metrics.jsonl"
    assert run.timeline.parent == run.utilization.parent == run.rollout.parent == run.path
    assert run.checkpoint(7) == run.checkpoints / "step-000007"
    assert run.trainer_state(run.checkpoint(7)).parent == run.checkpoint(7)
    assert run.latest.parent == run.incarnation.parent == run.checkpoints
    assert run.node_log("gen-0") == run.logs / "gen-0.log"
    assert run.report.parent == run.admin_token.parent == run.sbatch.parent == run.path
    assert run.tensorboard.parent == run.wandb.parent == run.mlruns.parent == run.path
    assert not run.path.exists()  # naming a file creates nothing


def test_latest_names_the_newest_checkpoint_once_one_is_complete(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.latest_checkpoint() is None and run.latest_step() is None
    for step in (10, 20, 30):
        run.checkpoint(step).mkdir(parents=True)
    run.point_latest_at(run.checkpoint(20))
    assert run.latest_checkpoint() == run.checkpoint(20)
    assert run.latest_step() == 20
    assert run.saved_checkpoints() == [run.checkpoint(10), run.checkpoint(20), run.checkpoint(30)]
    assert not list(run.checkpoints.glob(".*"))  # the pointer's scratch file is gone
    run.latest.write_text("garbage\n")
    assert run.latest_step() is None


def test_complete_checkpoint_is_the_latest_or_the_step_asked_for_once_its_trainer_state_is_written(
    tmp_path: Path,
) -> None:
    run = RunDir(tmp_path)
    with pytest.raises(RunDirError, match=r"no checkpoint in .*latest does not exist \(none here is complete\)"):
        run.complete_checkpoint()
    for step in (10, 20):
        run.checkpoint(step).mkdir(parents=True)
        run.trainer_state(run.checkpoint(step)).write_bytes(b"state")
    run.checkpoint(30).mkdir()  # the engine's part is there, the trainer state not yet
    run.point_latest_at(run.checkpoint(20))
    assert run.complete_checkpoint() == run.checkpoint(20)
    assert run.complete_checkpoint(10) == run.checkpoint(10)
    with pytest.raises(
        RunDirError, match=r"step-000030 is half-written: trainer.pt is missing .*step-000010, step-000020"
    ):
        run.complete_checkpoint(30)
    with pytest.raises(
        RunDirError, match=r"step-000040 does not exist \(complete ones here: step-000010, step-000020\)"
    ):
        run.complete_checkpoint(40)
    run.point_latest_at(run.checkpoint(30))  # never done by a trainer: `latest` moves last
    with pytest.raises(RunDirError, match="half-written"):
        run.complete_checkpoint()


def test_jsonl_round_trip_and_a_cut_last_line_is_dropped(tmp_path: Path) -> None:
    path = RunDir(tmp_path / "deep" / "run").metrics
    log = JsonlLog(path)  # makes the folder
    log.write([{"step": 1}, {"step": 2, "tasks": {"copy": {"reward_mean": 0.5}}}])
    log.write([])  # nothing to write: the file is left alone
    with path.open("ab") as out:
        out.write(b'{"step": 3, "el')  # a writer killed mid-line
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "tasks": {"copy": {"reward_mean": 0.5}}}]


def test_a_cut_line_in_the_middle_is_corruption_unless_reading_leniently(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "el{"step": 2}\n{"step": 3}\n')
    with pytest.raises(RunDirError, match=r"metrics\.jsonl:2"):
        read_jsonl(path)
    assert read_jsonl(path, lenient=True) == [{"step": 1}, {"step": 3}]


def test_importing_it_pulls_in_no_torch() -> None:
    code = "import sys, rollart.rundir; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
