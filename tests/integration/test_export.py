"""`rollart export`: a run folder's checkpoint, from either training backend, as a Hugging Face folder.

Each backend trains two steps on the tiny model and checkpoints into a run folder as the trainer
node lays one out (`RunDir.checkpoint`, `trainer.pt`, then `latest`); the export must load with
`transformers.AutoModelForCausalLM.from_pretrained` alone and hold exactly the engine's weights
(`export_weights`), in the dtype asked for, without the optimizer state. Then what a user gets
wrong: no checkpoint, a half-written one, an OUT that is in the way.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rollart.cli import main
from rollart.rundir import RunDir
from rollart.testkit.batches import random_batch
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

STEPS = 2


def trained_run(model: Path, run_dir: Path, spec: TrainerSpec) -> dict[str, torch.Tensor]:
    """Train `STEPS` steps, checkpoint into `run_dir` as the trainer node does; the engine's weights."""
    torch.set_num_threads(1)
    engine = build_training_engine(spec, model, seed=0)
    try:
        for step in range(STEPS):
            engine.train_step(random_batch(step, rows=5), version=step)
        run = RunDir(run_dir)
        path = run.checkpoint(STEPS)
        engine.save(path).result()
        torch.save({"step": STEPS}, run.trainer_state(path))
        run.point_latest_at(path)
        return {name: tensor.clone() for name, tensor in engine.export_weights().items()}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def torch_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    run_dir = tmp_path_factory.mktemp("torch-run")
    spec = TrainerSpec(device="cpu", threads=1, micro_batch_size=3)
    return run_dir, trained_run(tiny_model, run_dir, spec)


@pytest.fixture(scope="module")
def fsdp_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    run_dir = tmp_path_factory.mktemp("fsdp-run")
    spec = TrainerSpec(backend="fsdp2", ranks=2, device="cpu", threads=1, micro_batch_size=3)
    return run_dir, trained_run(tiny_model, run_dir, spec)


def assert_exported(out: Path, expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert model.dtype == dtype
    weights = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor.to(dtype)), name
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id is not None
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not {"optimizer.pt", "trainer.pt", "engine.json", "dcp"} & names  # no training state


@pytest.mark.parametrize(("dtype", "expected"), [("auto", torch.float32), ("bf16", torch.bfloat16)])
def test_a_torch_checkpoint_exports_as_the_engine_weights(
    torch_run: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, dtype: str, expected: torch.dtype
) -> None:
    run_dir, weights = torch_run
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--dtype", dtype]) == 0
    assert_exported(tmp_path / "out", weights, expected)


@pytest.mark.parametrize(("dtype", "expected"), [("auto", torch.float32), ("bf16", torch.bfloat16)])
def test_an_fsdp2_checkpoint_of_two_ranks_exports_as_the_engine_weights(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dtype: str,
    expected: torch.dtype,
) -> None:
    run_dir, weights = fsdp_run
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--dtype", dtype]) == 0
    assert_exported(tmp_path / "out", weights, expected)
    err = capsys.readouterr().err
    assert "without the optimizer state" in err and f"export: wrote {tmp_path / 'out'}" in err  # progress


def test_step_and_checkpoint_pick_a_checkpoint_other_than_the_latest(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    run_dir, weights = fsdp_run
    name = RunDir(run_dir).checkpoint(STEPS).name
    assert main(["export", str(run_dir), str(tmp_path / "a"), "--step", str(STEPS)]) == 0
    assert main(["export", str(run_dir), str(tmp_path / "b"), "--checkpoint", name]) == 0
    assert_exported(tmp_path / "b", weights, torch.float32)


def test_a_run_folder_without_a_checkpoint_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_half_written_checkpoint_is_refused(
    torch_run: tuple[Path, dict[str, torch.Tensor]],
    fsdp_run: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the engine's part written, the trainer state not yet: the run stopped while saving
    run = RunDir(tmp_path / "run")
    shutil.copytree(torch_run[0], run.path)
    shutil.copytree(run.checkpoint(STEPS), run.checkpoint(STEPS + 1))
    run.trainer_state(run.checkpoint(STEPS + 1)).unlink()
    assert main(["export", str(run.path), str(tmp_path / "out"), "--step", str(STEPS + 1)]) == 2
    assert "step-000003 is half-written: trainer.pt is missing" in capsys.readouterr().err
    # shards whose metadata (written last) never came
    cut = tmp_path / "cut"
    shutil.copytree(RunDir(fsdp_run[0]).checkpoint(STEPS), cut)
    (cut / "dcp" / ".metadata").unlink()
    assert main(["export", str(run.path), str(tmp_path / "out"), "--checkpoint", str(cut)]) == 2
    assert "a half-written fsdp2 checkpoint (dcp/.metadata missing)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_out_folder_in_the_way_is_replaced_only_with_force(
    torch_run: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, weights = torch_run
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(run_dir), str(out)]) == 0  # an empty folder is fine
    (out / "mine.txt").write_text("keep me")
    assert main(["export", str(run_dir), str(out)]) == 2
    assert "is not empty (--force replaces it)" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "keep me"
    assert main(["export", str(run_dir), str(out), "--force"]) == 0
    assert not (out / "mine.txt").exists()
    assert_exported(out, weights, torch.float32)
    assert not list(tmp_path.glob(".out.export-*"))  # no staging folder left behind
    assert main(["export", str(run_dir), str(RunDir(run_dir).checkpoint(STEPS)), "--force"]) == 2
    assert "must not contain each other" in capsys.readouterr().err  # --force never deletes the checkpoint
