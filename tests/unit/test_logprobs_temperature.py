"""The trainer scores tokens under the distribution they were sampled from: each generated token's log-prob is
log_softmax(logits / temperature), with the temperature `pack_batch` records per token (`PackedBatch.temperature`,
`run.rollout.sampling.temperature`), in both ways `PolicyLogprobs` applies the output head (all at once; chunked)
and with rows sharing their reads. Top-p below 1 is refused in training runs: the trainer would have to cut each
position's vocabulary as vLLM does, and does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollart.algorithms.grpo import pack_batch
from rollart.models.loading import load_model_and_tokenizer
from rollart.rollout.config import SamplingSpec
from rollart.testkit.batches import Seq
from rollart.training.logprobs import PolicyLogprobs, policy_logprobs

SEQS = [
    Seq([5, 70, 71, 72, 6], [40, 41, 42, 3], [1, 1, 1, 1], [-4.0] * 4, [1] * 4),
    Seq([5, 70, 71, 72, 6], [40, 41, 43, 44, 45, 3], [1, 1, 1, 1, 1, 1], [-4.0] * 6, [1] * 6),  # a shared read
    Seq([5, 80, 6], [50, 51, 3, 9, 60, 6, 52, 3], [1, 1, 1, 0, 0, 0, 1, 1], [-4.0] * 8, [1] * 8),
]


@pytest.mark.parametrize("chunk_tokens", [0, 3], ids=["whole-head", "chunked-head"])
@pytest.mark.parametrize("share_reads", [False, True], ids=["apart", "shared-reads"])
def test_temperature_logprobs_are_the_log_softmax_of_the_logits_over_the_temperature(
    tiny_model: Path, chunk_tokens: int, share_reads: bool
) -> None:
    model, _ = load_model_and_tokenizer(tiny_model)
    batch = pack_batch(SEQS, [1.0, -1.0, 0.5], pad_id=0, temperature=0.7)
    assert torch.equal(batch.temperature, torch.full(batch.input_ids.shape, 0.7))
    with torch.no_grad():
        got = policy_logprobs(PolicyLogprobs(model, chunk_tokens=chunk_tokens, share_reads=share_reads), batch)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    tempered = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    want = torch.nn.functional.pad(tempered, (1, 0)) * batch.loss_mask
    torch.testing.assert_close(got * batch.loss_mask, want, atol=2e-5, rtol=0)
    plain = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert (torch.nn.functional.pad(plain, (1, 0)) * batch.loss_mask - want).abs().max() > 0.05  # it matters


def test_temperature_logprobs_a_batch_is_packed_only_at_a_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        pack_batch(SEQS, [1.0, -1.0, 0.5], pad_id=0, temperature=0.0)


def test_temperature_logprobs_refuse_top_p_below_1_and_greedy_sampling_in_training() -> None:
    problems = dict(SamplingSpec(temperature=0.7, top_p=0.9).validate(train=True))
    assert list(problems) == ["top_p"] and "top_p: 1" in problems["top_p"]
    assert list(dict(SamplingSpec(temperature=0.0).validate(train=True))) == ["temperature"]
    assert SamplingSpec(temperature=0.7).validate(train=True) == []
    assert SamplingSpec(temperature=0.0, top_p=0.9).validate(train=False) == []  # rollouts alone: anything valid
    assert list(dict(SamplingSpec(temperature=-1.0, top_p=1.5).validate(train=False))) == ["temperature", "top_p"]
