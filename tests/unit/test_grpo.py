"""GRPO: advantages, packing, token log-probs and the decoupled PPO loss against numbers worked by hand."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from rollart.algorithms.grpo import (
    K3_MAX,
    GRPOConfig,
    PackedBatch,
    group_advantages,
    grpo_loss,
    k3,
    pack_batch,
    ragged_group_advantages,
    staleness,
    token_logprobs,
)
from rollart.algorithms.selection import groups_with_signal
from rollart.testkit.batches import Seq


def row_batch(*, mask: list[float], behaviour: list[float], advantages: list[float]) -> PackedBatch:
    """A one-sequence batch in float64 with the given per-position values."""
    t = len(mask)
    return PackedBatch(
        input_ids=torch.zeros((1, t), dtype=torch.long),
        attention_mask=torch.ones((1, t), dtype=torch.long),
        loss_mask=torch.tensor([mask], dtype=torch.float64),
        behaviour_logprobs=torch.tensor([behaviour], dtype=torch.float64),
        advantages=torch.tensor([advantages], dtype=torch.float64),
        versions=torch.zeros((1, t), dtype=torch.long),
        sources=torch.full((1, t), -1, dtype=torch.long),
        temperature=torch.ones((1, t), dtype=torch.float64),
    )


def logs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# advantages


def test_group_advantages_centre_on_the_group_mean_and_divide_by_the_population_std() -> None:
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]]), eps=0.0)
    # group 0: mean 0.5, population std sqrt((4 * 0.25) / 4) = 0.5
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # group 1: mean 0.75, deviations -0.75 (x3), 2.25; variance (3 * 0.5625 + 5.0625) / 4 = 1.6875
    std = math.sqrt(1.6875)
    assert adv[1].tolist() == pytest.approx([-0.75 / std, -0.75 / std, -0.75 / std, 2.25 / std])


def test_groups_cut_short_get_advantages_against_their_own_members() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [2.0, 2.0]]
    adv = ragged_group_advantages(rewards, eps=0.0)
    whole = group_advantages(torch.tensor([rewards[0], rewards[2]]), eps=0.0).tolist()
    assert adv[0] == pytest.approx(whole[0]) and adv[2] == pytest.approx(whole[1])  # in their places
    # three of four kept: mean 1/3, population std sqrt(2) / 3
    std = math.sqrt(2) / 3
    assert adv[1] == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std])
    assert adv[3] == [0.0, 0.0]  # equal rewards: nothing to prefer


def test_group_advantages_add_eps_to_the_std() -> None:
    adv = group_advantages(torch.tensor([[1.0, 0.0]]), eps=0.5)
    assert adv[0].tolist() == pytest.approx([0.5 / (0.5 + 0.5), -0.5 / (0.5 + 0.5)])


def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero() -> None:
    adv = group_advantages(torch.tensor([[0.1, 0.1, 0.1], [2.0, 2.0, 2.0], [1.0, 0.0, 1.0]]))
    assert adv[:2].tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert adv[2].abs().sum() > 0
    assert group_advantages(torch.tensor([[0.1, 0.1, 0.1]]), normalize_std=False).tolist() == [[0.0, 0.0, 0.0]]


def test_without_std_normalization_advantages_are_reward_minus_group_mean() -> None:
    adv = group_advantages(torch.tensor([[0.0, 0.0, 0.0, 3.0], [1, 0, 0, 1]]), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-0.75, -0.75, -0.75, 2.25], [0.5, -0.5, -0.5, 0.5]]))


def test_group_advantages_want_a_matrix() -> None:
    with pytest.raises(ValueError, match="groups, G"):
        group_advantages(torch.tensor([1.0, 0.0]))


# config


def test_config_defaults_are_valid_and_bad_values_are_named() -> None:
    assert GRPOConfig().validate() == []
    assert GRPOConfig().clip_high == 0.2
    assert GRPOConfig(clip_eps_high=0.28).clip_high == 0.28
    bad = GRPOConfig(clip_eps=0.0, clip_eps_high=-0.1, tis_cap=0.5, kl_coef=-1.0, adv_eps=0.0).validate()
    assert [key for key, _ in bad] == ["clip_eps", "clip_eps_high", "tis_cap", "kl_coef", "adv_eps"]
    with pytest.raises(msgspec.ValidationError, match="clip_epsilon"):
        msgspec.convert({"clip_epsilon": 0.2}, GRPOConfig)


# the loss


CFG = GRPOConfig(clip_eps=0.2, clip_eps_high=0.3, tis_cap=2.0)

# Position 0 is prompt; 1-5 are loss tokens; 6 is an observation token whose log-probs would overflow.
#            pos:      1      2      3      4      5
# r = new / prox:    1.1    1.4    0.7    1.0    1.5
# prox / mu:         1      1      1      3      1
# advantage:         1      1     -2      0.5   -1
NEW = [0.0, *logs(0.55, 0.56, 0.35, 0.6, 0.75), 0.0]
PROX = [0.0, *logs(0.5, 0.4, 0.5, 0.6, 0.5), -1000.0]
MU = [0.0, *logs(0.5, 0.4, 0.5, 0.2, 0.5), 0.0]
ADV = [0.0, 1.0, 1.0, -2.0, 0.5, -1.0, 0.0]
MASK = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_the_loss_clips_the_ratio_and_truncates_the_behaviour_weight() -> None:
    new = torch.tensor([NEW], dtype=torch.float64, requires_grad=True)
    batch = row_batch(mask=MASK, behaviour=MU, advantages=ADV)
    loss, stats = grpo_loss(new, torch.tensor([PROX], dtype=torch.float64), batch, CFG, total_tokens=10)
    # per token, -w * min(r A, clip(r, 0.8, 1.3) A):
    # 1: inside the clip range             -1 * 1.1 * 1             = -1.1
    # 2: r = 1.4 > 1.3, A > 0: clipped      -1 * 1.3 * 1             = -1.3
    # 3: r = 0.7 < 0.8, A < 0: clipped      -1 * min(-1.4, -1.6)     = +1.6
    # 4: w = min(3, 2) = 2                 -2 * 1.0 * 0.5           = -1.0
    # 5: r = 1.5 > 1.3 but A < 0: unclipped -1 * min(-1.5, -1.3)     = +1.5
    # divided by the whole batch's 10 loss tokens
    assert loss.item() == pytest.approx((-1.1 - 1.3 + 1.6 - 1.0 + 1.5) / 10)
    loss.backward()
    assert new.grad is not None
    # d/d new of -w r A is -w A r where the unclipped branch is taken, 0 where the clip is active
    expected = [0.0, -1 * 1 * 1.1 / 10, 0.0, 0.0, -2 * 0.5 * 1.0 / 10, -1 * -1 * 1.5 / 10, 0.0]
    assert new.grad[0].tolist() == pytest.approx(expected)
    assert stats.means() == pytest.approx(
        {
            "policy_loss": (-1.1 - 1.3 + 1.6 - 1.0 + 1.5) / 5,
            "kl": 0.0,
            "importance_ratio_mean": (1 + 1 + 1 + 3 + 1) / 5,
            "importance_ratio_max": 3.0,
            "truncated_frac": 1 / 5,
            "clipped_frac": 2 / 5,
            "anchor_kl": 0.0,
            "mismatch_frac": 0.0,  # no version given: no token counts as the step's own
        }
    )
    assert stats.means(10)["clipped_frac"] == pytest.approx(2 / 10)


def test_without_clip_eps_high_the_upper_clip_is_clip_eps() -> None:
    new = torch.tensor([[0.0, math.log(1.25)]], dtype=torch.float64, requires_grad=True)
    batch = row_batch(mask=[0.0, 1.0], behaviour=[0.0, 0.0], advantages=[0.0, 1.0])
    loss, _ = grpo_loss(new, torch.zeros((1, 2), dtype=torch.float64), batch, GRPOConfig(clip_eps=0.2), total_tokens=1)
    assert loss.item() == pytest.approx(-1.2)  # r = 1.25 clipped to 1 + 0.2


def test_the_kl_term_is_k3_to_the_reference_policy() -> None:
    new = torch.tensor([[0.0, math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[0.0, math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[0.0, math.log(1.0)]], dtype=torch.float64)
    batch = row_batch(mask=[0.0, 1.0], behaviour=[0.0, math.log(0.5)], advantages=[0.0, 0.0])
    cfg = GRPOConfig(kl_coef=0.1)
    loss, stats = grpo_loss(new, prox, batch, cfg, total_tokens=1, ref_logprobs=ref)
    # ref - new = ln 2: k3 = e^(ln 2) - ln 2 - 1 = 1 - ln 2; the advantage is 0, so only KL counts
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert stats.means()["kl"] == pytest.approx(1 - math.log(2))
    loss.backward()
    assert new.grad is not None
    # d k3 / d new = 1 - e^(ref - new) = 1 - 2
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.1 * (1 - 2)])
    # the KL is reported without being optimized when kl_coef is 0
    loss0, stats0 = grpo_loss(new, prox, batch, GRPOConfig(), total_tokens=1, ref_logprobs=ref)
    assert loss0.item() == 0.0
    assert stats0.means()["kl"] == pytest.approx(1 - math.log(2))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(new, prox, batch, cfg, total_tokens=1)


def test_the_kl_term_is_bounded_where_the_policy_gives_a_token_far_less_than_the_reference() -> None:
    """Unbounded, k3 grows as e^(ref - new): a token whose probability fell by 9 nats alone weighs 8,000."""
    new = torch.tensor([[0.0, -9.0, math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    batch = row_batch(mask=[0.0, 1.0, 1.0], behaviour=[0.0, -9.0, math.log(0.5)], advantages=[0.0, 0.0, 0.0])
    loss, stats = grpo_loss(new, new.detach(), batch, GRPOConfig(kl_coef=0.1), total_tokens=2, ref_logprobs=ref)
    assert stats.means()["kl"] == pytest.approx((K3_MAX + 1 - math.log(2)) / 2)
    loss.backward()
    assert new.grad is not None  # the capped token gets no KL gradient; the other one its own
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.1 * (1 - 2) / 2])
    assert k3(torch.tensor([1e4, -1e4, 0.0])).tolist() == pytest.approx([K3_MAX, K3_MAX, 0.0])


def test_the_anchor_is_k3_to_the_steps_starting_policy_on_zero_advantage_tokens_too() -> None:
    new = torch.tensor([[0.0, math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[0.0, math.log(1.0)]], dtype=torch.float64)
    batch = row_batch(mask=[0.0, 1.0], behaviour=[0.0, 0.0], advantages=[0.0, 0.0])
    loss, stats = grpo_loss(new, prox, batch, GRPOConfig(anchor_coef=0.5), total_tokens=1)
    # prox - new = ln 2: k3 = 1 - ln 2, though the advantage is 0 (a group without signal)
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)))
    assert stats.means()["anchor_kl"] == pytest.approx(1 - math.log(2))
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.5 * (1 - 2)])  # pulls new back up toward prox
    # before the first update new == prox: no anchor, no gradient from it
    same = new.detach().clone().requires_grad_(True)
    assert grpo_loss(same, same.detach(), batch, GRPOConfig(anchor_coef=0.5), total_tokens=1)[0].item() == 0.0
    assert GRPOConfig(anchor_coef=-1.0).validate() == [("anchor_coef", "expected a value >= 0; got -1.0")]


def test_the_loss_refuses_log_probs_of_another_shape() -> None:
    batch = row_batch(mask=[0.0, 1.0], behaviour=[0.0, 0.0], advantages=[0.0, 1.0])
    with pytest.raises(ValueError, match="prox_logprobs has shape"):
        grpo_loss(torch.zeros((1, 2)), torch.zeros((1, 3)), batch, CFG, total_tokens=1)


class TinyCausalLM(torch.nn.Module):
    """Logits at position t from token t alone: causal by construction."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))  # type: ignore[no-any-return]


def gradients(model: TinyCausalLM, prox_model: TinyCausalLM, batch: PackedBatch, size: int) -> list[torch.Tensor]:
    model.zero_grad()
    cfg = GRPOConfig(clip_eps=0.1, tis_cap=1.5)
    for mb in batch.micro_batches(size):
        with torch.no_grad():
            prox = token_logprobs(prox_model(mb.input_ids), mb.input_ids)
        new = token_logprobs(model(mb.input_ids), mb.input_ids)
        loss, _ = grpo_loss(new, prox, mb, cfg, total_tokens=batch.loss_tokens)
        loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_micro_batch_gradients_add_up_to_the_whole_batch_gradient() -> None:
    torch.manual_seed(0)
    vocab = 11
    model, prox_model = TinyCausalLM(vocab), TinyCausalLM(vocab)
    seqs = []
    for length in (3, 7, 2, 5, 6):
        mask = [1 if i % 3 != 2 else 0 for i in range(length)]
        seqs.append(
            Seq(
                prompt_ids=[1, 2],
                response_ids=torch.randint(1, vocab, (length,)).tolist(),
                response_mask=mask,
                logprobs=[-2.4 * m for m in mask],
                versions=[3 if m else -1 for m in mask],
            )
        )
    batch = pack_batch(seqs, [1.0, -0.5, 0.3, -1.2, 0.8], pad_id=0)
    whole = gradients(model, prox_model, batch, size=5)
    assert len(whole) == 3
    for size in (2, 3, 1):
        for split, full in zip(gradients(model, prox_model, batch, size=size), whole, strict=True):
            torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-7)


# packing


SEQS = [
    Seq(
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        response_mask=[1, 0, 1],
        logprobs=[-0.1, 0.0, -0.3],
        versions=[3, -1, 4],
    ),
    Seq(prompt_ids=[5], response_ids=[7], response_mask=[1], logprobs=[-0.2], versions=[4]),
]


def test_pack_batch_aligns_every_tensor_on_prompt_plus_response_positions() -> None:
    batch = pack_batch(SEQS, [0.5, -1.0], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor([[0, 0, -0.1, 0, -0.3], [0, -0.2, 0, 0, 0]]))
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0, 0.5], [0, -1, 0, 0, 0]]
    assert batch.versions.tolist() == [[-1, -1, 3, -1, 4], [-1, 4, -1, -1, -1]]
    assert batch.loss_tokens == 3
    assert len(batch) == 2


def test_pack_batch_gives_each_segment_its_own_row_with_the_trajectorys_advantage() -> None:
    # Two turns with fresh prompts (`context: last`): [5 6 | 7] then [8 9 | 4]; 3 is the first reply's end.
    turns = Seq(
        prompt_ids=[5, 6],
        response_ids=[7, 3, 8, 9, 4],
        response_mask=[1, 1, 0, 0, 1],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.4],
        versions=[2, 2, -1, -1, 3],
        segments=[2],
    )
    batch = pack_batch([turns, SEQS[1]], [0.5, -1.0], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 3], [8, 9, 4, 0], [5, 7, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 0, 0]]
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0.5], [0, 0, 0.5, 0], [0, -1, 0, 0]]
    assert batch.versions.tolist() == [[-1, -1, 2, 2], [-1, -1, 3, -1], [-1, 4, -1, -1]]
    torch.testing.assert_close(batch.behaviour_logprobs[1], torch.tensor([0, 0, -0.4, 0]))
    assert batch.loss_tokens == 4 and len(batch) == 3


def test_micro_batches_slice_rows_and_drop_their_padding_columns() -> None:
    batch = pack_batch([*SEQS, SEQS[1]], [0.5, -1.0, 2.0], pad_id=0)
    parts = list(batch.micro_batches(2))
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 5), (1, 2)]
    assert parts[1].input_ids.tolist() == [[5, 7]]
    assert parts[1].advantages.tolist() == [[0, 2.0]]
    assert sum(p.loss_tokens for p in parts) == batch.loss_tokens == 4
    with pytest.raises(ValueError, match="size"):
        next(batch.micro_batches(0))


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (Seq([1], [2, 3], [1], [-0.1, -0.2], [0, 0]), "response_ids has 2 tokens"),
        (Seq([1], [2, 3], [1, 1], [-0.1], [0, 0]), "response_ids has 2 tokens"),
        (Seq([1], [2], [1], [-0.1], [0, 0]), "response_ids has 1 tokens"),
        (Seq([], [2], [1], [-0.1], [0]), "empty prompt"),
        (Seq([1], [2], [2], [-0.1], [0]), "response_mask"),
        (Seq([1], [2, 3, 4], [1, 0, 1], [-0.1, 0, -0.2], [0, -1, 0], [0]), "segments"),
        (Seq([1], [2, 3, 4], [1, 0, 1], [-0.1, 0, -0.2], [0, -1, 0], [2, 1]), "segments"),
        (Seq([1], [2, 3, 4], [1, 0, 1], [-0.1, 0, -0.2], [0, -1, 0], [2]), "starts on a generated token"),
    ],
)
def test_pack_batch_refuses_inconsistent_sequences(seq: Seq, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_batch([SEQS[0], seq], [0.0, 0.0], pad_id=0)


def test_pack_batch_wants_one_advantage_per_sequence() -> None:
    with pytest.raises(ValueError, match="2 sequences but 1 advantages"):
        pack_batch(SEQS, [0.0], pad_id=0)
    with pytest.raises(ValueError, match="no sequences"):
        pack_batch([], [], pad_id=0)


# token log-probs and staleness


def test_token_logprobs_read_token_t_from_the_logits_at_t_minus_1() -> None:
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0], [math.log(1), math.log(2), math.log(3)], [50.0, -50.0, 0.0]],
            [[math.log(1), math.log(3), 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        ]
    )
    input_ids = torch.tensor([[0, 1, 2], [2, 1, 0]])
    out = token_logprobs(logits.to(torch.bfloat16), input_ids)
    assert out.dtype == torch.float32
    # row 0: uniform over 3 -> 1/3; then probabilities 1/6, 2/6, 3/6 -> token 2 gets 1/2
    # row 1: probabilities 1/5, 3/5, 1/5 -> token 1 gets 3/5; then uniform -> 1/3
    expected = torch.tensor([[0.0, math.log(1 / 3), math.log(1 / 2)], [0.0, math.log(3 / 5), math.log(1 / 3)]])
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-2)  # bfloat16 logits
    torch.testing.assert_close(token_logprobs(logits, input_ids), expected, rtol=0, atol=1e-6)


def test_staleness_counts_versions_behind_on_loss_tokens_only() -> None:
    versions = torch.tensor([[-1, 3, 4], [5, -1, -1]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # behind version 5: 2, 1, 0
    assert staleness(versions, mask, 5) == {"staleness_mean": 1.0, "staleness_max": 2.0}
    assert staleness(versions, torch.zeros_like(mask), 5) == {"staleness_mean": 0.0, "staleness_max": 0.0}


def test_the_groups_with_signal_are_those_whose_advantages_are_not_all_zero() -> None:
    rewards = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.25, 0.25, 0.25], [0.3, 0.3, 0.2]]
    advantages = group_advantages(torch.tensor(rewards))
    assert groups_with_signal(rewards) == [1, 3]
    assert [i for i in range(len(rewards)) if bool(advantages[i].ne(0).any())] == [1, 3]
    assert groups_with_signal(torch.zeros(2, 4).tolist()) == []
