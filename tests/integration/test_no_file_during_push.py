"""No file is created while a weight push goes into the transformers engine: a real `WeightPublisher` ->
`WeightReceiver(engine.load_weights)` push over loopback TCP, watched with inotify in TMPDIR, /dev/shm and the run
folder. And the watch itself: it does see what the vLLM engine's old staging route wrote (a safetensors file in a
folder made before the push) and a shared-memory segment, so an empty report means something.

The vLLM engine's own test is tests/slow/test_vllm_streamed_weights.py (it needs vLLM).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollart.generation.engine import SamplingParams
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import PROMPTS, build_engine_test_model, hf_greedy, noisy_weights
from tests.filewatch import SHM, FileWatch, private_tmpdir
from tests.weight_push import push_over_tcp

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


@pytest.mark.timeout(120)
async def test_no_file_during_push_into_the_hf_engine(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with private_tmpdir(tmp_path / "tmp") as tmp:
        model_dir = build_engine_test_model(run / "model")
        reference, tokenizer = load_model_and_tokenizer(model_dir)
        new_weights = noisy_weights(reference, seed=2, scale=0.1)  # no lm_head.weight: tied to the embeddings
        updated, _ = load_model_and_tokenizer(model_dir)
        updated.load_state_dict(new_weights, strict=False)
        prompt = tokenizer.encode(PROMPTS[2])
        engine = HFEngine(model_dir)
        await engine.start()
        try:
            with FileWatch([tmp, SHM, run]) as watch:
                stats = await push_over_tcp(engine.load_weights, 1, new_weights)
                # Staged by load_weights, copied into the model before the next batch: this one.
                after = await engine.generate("after", prompt, SamplingParams(max_tokens=16, temperature=0.0))
        finally:
            await engine.close()
    assert watch.touched() == []
    assert stats.version == engine.version == 1
    assert after.versions == [1] * 16
    assert after.token_ids == hf_greedy(updated, prompt, 16) != hf_greedy(reference, prompt, 16)


def test_no_file_during_push_watch_sees_the_old_staging_file_and_shared_memory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with private_tmpdir(tmp_path / "tmp") as tmp:
        # What the vLLM engine did until now: a staging folder made at start, before any push ...
        staging = Path(tempfile.mkdtemp(prefix="rollart-vllm-weights-"))
        staged = staging / "model.safetensors"
        with FileWatch([tmp, SHM, run]) as watch:
            save_file({"model.norm.weight": torch.ones(128)}, str(staged))  # ... each version written into it
            staged.unlink()  # ... and removed once vLLM had read it
            shared = torch.zeros(1024).share_memory_()  # a POSIX shared-memory segment, as torch.multiprocessing makes
            (run / "note.txt").write_text("x")
    touched = watch.touched()
    assert str(staged) in touched
    assert any(path.startswith(f"{SHM}/torch_") for path in touched), touched
    assert str(run / "note.txt") in touched
    del shared
