"""The trainer's CUDA paths that CPU tests cannot reach, on a GPU (skipped without one).

`bin/gpu-check` runs this file on the GPU machine after its table. What it checks:
- a group's answers reading their prompt once (`shared_heads`: the prompt's keys and values as a padded
  past under the GPU's attention kernel) give the log-probs and gradients of reading every row apart,
  in fp32 and under bf16 autocast (the CPU version: tests/unit/test_torch_trainer.py);
- the torch engine trains on the GPU in bf16 with shared reads as it does without them, and exports
  its weights for the weight push.

Tolerances: fp32 on a GPU agrees to about 1e-6 as on CPU, but the attention kernels it picks depend
on the shapes, and the two ways read different shapes, so 1e-4 here. Under bf16 autocast each matmul
rounds to 8 mantissa bits (about 4e-3), so the two ways agree to a few hundredths of a log-prob.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.models.loading import load_model_and_tokenizer
from rollart.testkit.batches import grouped_batch
from rollart.tiny.model import build_tiny_model
from rollart.training.logprobs import PolicyLogprobs, shared_heads, shared_reads
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bin/gpu-check runs it on one)"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def scored(
    lm: torch.nn.Module, batch: PackedBatch, *, share: bool, bf16: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss tokens' log-probs (0 elsewhere) and every parameter's gradient of their advantage-weighted sum."""
    lm.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = PolicyLogprobs(lm, chunk_tokens=5, share_reads=share)(
            batch.input_ids, batch.attention_mask, batch.loss_mask
        )
    (out * batch.loss_mask * batch.advantages).sum().backward()
    grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    return out.detach() * batch.loss_mask, grads


@pytest.mark.parametrize(("bf16", "tolerance"), [(False, 1e-4), (True, 3e-2)], ids=["fp32", "bf16"])
def test_a_groups_answers_read_their_prompt_once_and_score_as_apart_on_cuda(
    model_dir: Path, bf16: bool, tolerance: float
) -> None:
    batch = grouped_batch().to("cuda")
    reads, rows = shared_reads(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert shared_heads(reads, rows, batch.loss_mask) is not None  # the padded-past path is the one taken
    lm, _ = load_model_and_tokenizer(model_dir, device="cuda")
    apart, apart_grads = scored(lm, batch, share=False, bf16=bf16)
    shared, shared_grads = scored(lm, batch, share=True, bf16=bf16)
    loss_tokens = batch.loss_mask > 0
    assert torch.isfinite(shared).all() and (apart[loss_tokens] < 0).all()
    torch.testing.assert_close(shared, apart, rtol=tolerance, atol=tolerance)
    assert shared_grads.keys() == apart_grads.keys()
    for name, grad in apart_grads.items():
        assert float((shared_grads[name] - grad).norm() / grad.norm()) < tolerance, name


def test_the_torch_engine_trains_on_cuda_in_bf16_with_shared_reads_as_without(model_dir: Path) -> None:
    batch = grouped_batch()
    results = {}
    for share in (True, False):
        spec = TrainerSpec(backend="torch", device="cuda", precision="bf16", lr=1e-3, share_reads=share)
        engine = build_training_engine(spec, model_dir, seed=0)
        try:
            assert "bfloat16" in str(engine.describe())
            steps = [engine.train_step(replace(batch), version=2) for _ in range(2)]
            weights = engine.export_weights()
        finally:
            engine.close()
        assert all(math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) for step in steps)
        assert weights and all(tensor.device.type == "cuda" for tensor in weights.values())
        results[share] = steps, {name: tensor.float().cpu() for name, tensor in weights.items()}
    (shared_steps, shared_weights), (apart_steps, apart_weights) = results[True], results[False]
    for shared, apart in zip(shared_steps, apart_steps, strict=True):
        assert shared["tokens"] == apart["tokens"]
        assert shared["loss"] == pytest.approx(apart["loss"], rel=0.05, abs=0.01)
        assert shared["grad_norm"] == pytest.approx(apart["grad_norm"], rel=0.05)
    for name, tensor in apart_weights.items():  # two AdamW steps of lr 1e-3 from the same weights
        assert float((shared_weights[name] - tensor).norm() / tensor.norm()) < 1e-2, name
