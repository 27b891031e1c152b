"""The Megatron-Core backend on GPUs: real rank processes, NCCL, Megatron's DDP and distributed optimizer.

Skipped without CUDA (Megatron-Core 0.16's forward is CUDA-only; what runs on CPU is in
tests/unit/test_megatron_convert.py, including the step against the torch backend). On a GPU: the
engine is built on the tiny Qwen3 model (tied embeddings, q/k norms), trains 2 steps on a packed
batch, and its exported weights, loaded into a Hugging Face model, give the log-probs the engine
trains with (its next step's first pass is pi_prox: with fresh rows of mu = those log-probs, the
importance ratio is 1); a checkpoint saves and loads back. With 2 GPUs the same runs at tp=2 and pp=2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollart.algorithms.grpo import PackedBatch
from rollart.testkit.batches import random_batch, synthetic_batch
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the megatron backend needs CUDA GPUs"),
]


def hf_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[N, T] log-probs of the loss tokens under an HF model (0 elsewhere), fp32."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    picked = picked * (batch.loss_mask[:, 1:] > 0)
    return torch.nn.functional.pad(picked, (1, 0))


def with_behaviour(batch: PackedBatch, logprobs: torch.Tensor) -> PackedBatch:
    """The batch as if sampled by the policy whose log-probs these are (mu = pi_prox)."""
    from dataclasses import replace

    return replace(batch, behaviour_logprobs=logprobs * (batch.loss_mask > 0))


@pytest.mark.parametrize(
    ("ranks", "tp", "pp"),
    [(1, 1, 1), pytest.param(2, 2, 1, id="tp2"), pytest.param(2, 1, 2, id="pp2")],
)
def test_megatron_trains_and_exports_hf_weights(tiny_model: Path, tmp_path: Path, ranks: int, tp: int, pp: int) -> None:
    from rollart.models.loading import load_model_and_tokenizer

    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    spec = TrainerSpec(
        backend="megatron",
        ranks=ranks,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        precision="fp32",
        micro_batch_size=2,
        lr=1e-3,
    )
    engine = build_training_engine(spec, tiny_model, seed=0)
    try:
        stats = [engine.train_step(batch, version=3) for batch in (synthetic_batch(), random_batch(1, rows=6))]
        for step in stats:
            assert torch.isfinite(torch.tensor([step["loss"], step["grad_norm"]])).all()
            assert step["grad_norm"] > 0
        weights = engine.export_weights()
        model, _ = load_model_and_tokenizer(tiny_model)
        assert weights.keys() == model.state_dict().keys()
        model.load_state_dict(weights)
        assert engine.export_weights(torch.bfloat16)["lm_head.weight"].dtype == torch.bfloat16

        # the engine's log-probs are the exported model's: with mu set to HF's log-probs, the first
        # pass's importance ratio pi_prox / mu is 1 on every token
        batch = random_batch(2, rows=5)
        probe = with_behaviour(batch, hf_logprobs(model, batch))
        out: dict[str, Any] = engine.train_step(probe, version=3)
        assert out["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert out["importance_ratio_max"] == pytest.approx(1.0, abs=1e-3)

        saved = tmp_path / "ckpt"
        engine.save(saved).result(timeout=300)
        before = engine.export_weights()
        engine.train_step(synthetic_batch(), version=3)
        engine.load(saved)
        after = engine.export_weights()
        for name, tensor in before.items():
            assert torch.equal(after[name], tensor), name
        # the checkpoint folder is a Hugging Face model too
        reloaded, _ = load_model_and_tokenizer(saved)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, before[name]), name
    finally:
        engine.close()
