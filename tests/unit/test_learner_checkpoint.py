"""The learner's checkpoints with an engine that writes in the background, as fsdp2's does: `latest`
moves only once the engine's write is whole, so a write that fails (a rank died under it) leaves the
checkpoint before it as the one a restarted trainer resumes from, and says so in the log."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from rollart.errors import RollartError
from rollart.nodes.learner import Learner
from rollart.rundir import RunDir
from rollart.training.spec import TrainerSpec


class BackgroundWrites:
    """An engine whose `save` makes the folder and returns a write the test completes or fails."""

    pad_id = 0

    def __init__(self) -> None:
        self.writes: list[Future[None]] = []

    def save(self, path: Path) -> Future[None]:
        path.mkdir(parents=True)
        self.writes.append(Future())
        return self.writes[-1]


def learner(run_dir: RunDir, engine: BackgroundWrites) -> Learner:
    none: Any = None  # what checkpoints never touch: the engine builder
    targets: Any = SimpleNamespace(publisher=None)  # nor the weight publisher and its targets
    built = Learner(TrainerSpec(keep_checkpoints=3), run_dir=run_dir, targets=targets, build_engine=none)
    built.engine = engine  # type: ignore[assignment]
    return built


async def test_a_checkpoint_whose_write_fails_never_becomes_latest(tmp_path: Path) -> None:
    run_dir, engine = RunDir(tmp_path), BackgroundWrites()
    trainer = learner(run_dir, engine)
    dispenser = {"next_seed": 0}
    await trainer.checkpoint(step=2, version=2, elapsed_s=0.0, dispenser=dispenser)
    engine.writes[0].set_result(None)
    await trainer.saved()
    assert run_dir.latest_checkpoint() == run_dir.checkpoint(2)

    with capture_logs() as logs:
        await trainer.checkpoint(step=4, version=4, elapsed_s=0.0, dispenser=dispenser)
        assert run_dir.latest_checkpoint() == run_dir.checkpoint(2)  # staged, not yet written
        engine.writes[1].set_exception(RollartError("rank 1 (pid 7) exited with code -9"))
        with pytest.raises(RollartError, match="rank 1"):
            await trainer.saved()
    assert run_dir.latest_checkpoint() == run_dir.checkpoint(2)
    assert not run_dir.trainer_state(run_dir.checkpoint(4)).exists()
    (failed,) = [line for line in logs if line["event"] == "learner.checkpoint_failed"]
    assert failed["path"] == str(run_dir.checkpoint(4)) and "rank 1" in failed["error"]
