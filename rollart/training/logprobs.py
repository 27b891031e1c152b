"""Token log-probs of a causal LM without the whole `[N, T, V]` logits in memory.

`PolicyLogprobs` wraps a Hugging Face causal LM as the module a training engine runs: its forward
takes token ids and attention mask and returns each token's log-prob given the tokens before it
(`[N, T]` float32, 0 at t = 0 and on padding). Given the loss mask too, as the trainer gives it,
it scores the loss tokens alone: the loss reads no other log-prob, and in the default run's batch
they are 892 of 21,796 tokens. With `chunk_tokens > 0` it runs the decoder once, then the output
head on at most `chunk_tokens` scored positions at a time, keeping only each
position's log-sum-exp and target logit: in a backward pass each chunk is recomputed
(`torch.utils.checkpoint`), so at most one chunk's logits ever exist. At Qwen3's 151,936-token
vocabulary the fp32 logits of 16 rows of 1,024 tokens alone are 10 GB; a 1,024-token chunk is 0.6 GB.

Being the module FSDP2 shards at its root, the wrapper's forward runs with the root's parameters
(embeddings, final norm, output head) gathered; calling the decoder and head from outside it would
bypass FSDP2's hooks. The output head is the model's `get_output_embeddings()` applied to the
decoder's last hidden state, which is the whole head for Qwen, Qwen2.5 and Llama families; models
that scale or soft-cap logits after the head (Gemma 2) need `chunk_tokens: 0`.

Rows whose log-probs need the same tokens share one pass through the decoder (`shared_reads`):
a row's loss needs the log-probs of its generated tokens, which depend on the tokens before its
last generated one alone (the model is causal), so two rows with the same such prefix (every
FrozenLake turn from the same board under `context: last`, a group's identical answers) read the
same states. The decoder runs on the distinct prefixes; each row takes its positions' states from
its own prefix's row, and in the backward pass the gradients of the rows sharing one add up there,
as they would have in the decoder's weights. The default run's batch has 540 rows and 43 distinct
prefixes (`benchmarks/profile_step.py`).

Distinct prefixes that begin alike share that beginning too (`shared_heads`): a group's 8 answers
to one prompt differ from their first generated token on, but the prompt before it is the same.
Only the states from the position before a read's first loss token on are scored; the ones before
it are context, keys and values the later tokens attend to. So the decoder runs twice: once over
the distinct heads (each read's tokens before that position), keeping their keys and values, then
over each read's tail with its head's keys and values as the past (`DynamicCache`), its positions
numbered on from its head's end. Gradients flow back through the past to the head's pass. In the
`repeat` task's batch of 96 distinct answers to 12 prompts this reads 1,848 tokens instead of 5,856.
It is used where it saves a fifth of the padded tokens or more, and with `chunk_tokens > 0` only
(the decoder path: the whole model's forward may do more after the head). Not under FSDP2
(`share_heads=False`): there every decoder layer's forward is a collective, so every rank must run
the decoder as often as the others, and whether a micro-batch's reads are worth cutting is decided
from that rank's rows alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

HEAD_SAVING = 0.8
"""Split reads into heads and tails only when that reads at most this fraction of the padded tokens."""


def shared_reads(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct prefixes that rows' log-probs need: `(reads, rows)`, `reads` [U, W] their tokens
    (-1 after each prefix's end), `rows` [N] which of them each row reads.

    A row's prefix is its tokens before its last loss token (the whole row when it has none): the
    log-prob of every loss token depends on those alone. `torch.unique` orders `reads`, so the same
    rows give the same result wherever it is computed.
    """
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = torch.where(loss_mask > 0, positions, -1).amax(dim=1)
    length = torch.where(last > 0, last, attention_mask.sum(dim=1)).clamp(min=1)
    keyed = input_ids.masked_fill(positions >= length[:, None], -1)
    reads, rows = torch.unique(keyed, dim=0, return_inverse=True)
    return reads[:, : int(length.max())], rows


class Heads(NamedTuple):
    """Reads cut in two (`shared_heads`): `heads` [K, Wh] the distinct beginnings (-1 after each
    one's end), `head_of` [U] which one each read begins with, `tails` [U, Wt] the rest of each
    read (-1 after its end), `split` [U] where each read's tail begins."""

    heads: torch.Tensor
    head_of: torch.Tensor
    tails: torch.Tensor
    split: torch.Tensor


def shared_heads(reads: torch.Tensor, rows: torch.Tensor, loss_mask: torch.Tensor) -> Heads | None:
    """`reads` (from `shared_reads`) cut where the states their rows score begin: each read's head is
    its tokens before the position whose state predicts the first loss token of any row reading it.
    None when that would not save `HEAD_SAVING` of the padded tokens (nothing to share, or a read
    whose head would be empty)."""
    count, width = reads.shape
    length = (reads >= 0).sum(dim=1)
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    first = torch.where(loss_mask > 0, positions, loss_mask.shape[1]).amin(dim=1)
    split = torch.full((count,), width, dtype=torch.long, device=reads.device)
    split = split.scatter_reduce(0, rows, first - 1, "amin")
    split = torch.minimum(split, length - 1)
    if count == 0 or int(split.min()) < 1:
        return None
    keyed = reads.masked_fill(torch.arange(width, device=reads.device) >= split[:, None], -1)
    heads, head_of = torch.unique(keyed, dim=0, return_inverse=True)
    head_width, tail_width = int(split.max()), int((length - split).max())
    if len(heads) * head_width + count * tail_width > HEAD_SAVING * count * width:
        return None
    at = split[:, None] + torch.arange(tail_width, device=reads.device)
    tails = reads.gather(1, at.clamp(max=width - 1)).masked_fill(at >= length[:, None], -1)
    return Heads(heads[:, :head_width], head_of, tails, split)


def _run_heads(decoder: Any, cut: Heads) -> torch.Tensor:
    """The tails' last hidden states [U, Wt, H]: the heads' pass, then the tails' with their heads'
    keys and values as the past."""
    head_mask = (cut.heads >= 0).long()
    past = decoder(input_ids=cut.heads.clamp(min=0), attention_mask=head_mask, use_cache=True).past_key_values
    layers = [(layer.keys[cut.head_of], layer.values[cut.head_of]) for layer in past.layers]
    mask = torch.cat([head_mask[cut.head_of], (cut.tails >= 0).long()], dim=1)
    positions = cut.split[:, None] + torch.arange(cut.tails.shape[1], device=cut.tails.device)
    out = decoder(
        input_ids=cut.tails.clamp(min=0),
        attention_mask=mask,
        position_ids=positions,
        past_key_values=DynamicCache(ddp_cache_data=layers),
        use_cache=True,
    )
    hidden: torch.Tensor = out.last_hidden_state
    return hidden


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None = None
) -> torch.Tensor:
    logits: torch.Tensor = head(hidden).float()
    if temperature is not None:
        logits = logits / temperature[:, None]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class PolicyLogprobs(torch.nn.Module):
    """A causal LM whose forward returns token log-probs (module docstring)."""

    def __init__(self, lm: Any, *, chunk_tokens: int = 0, share_reads: bool = False, share_heads: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.share_reads = share_reads
        self.share_heads = share_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        temperature: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[N, T] log-probs, 0 at t = 0 and on padding. With a `loss_mask`, those of the loss tokens
        alone (0 elsewhere: the output head runs on no other position), and with `share_reads` only
        the rows' distinct prefixes go through the decoder. With `temperature` ([N, T], each token's sampling
        temperature), of the distribution each token was sampled from: log_softmax(logits / temperature)."""
        real = (attention_mask if loss_mask is None else loss_mask)[:, 1:] > 0
        ids, mask, rows = input_ids, attention_mask, None
        if self.share_reads and loss_mask is not None:
            reads, rows = shared_reads(input_ids, attention_mask, loss_mask)
            ids, mask = reads.clamp(min=0), (reads >= 0).long()
        where = real.nonzero(as_tuple=True)
        source = where if rows is None else (rows[where[0]], where[1])
        targets = input_ids[:, 1:][real]
        temperatures = None if temperature is None else temperature[:, 1:][real].float()
        if self.chunk_tokens <= 0:
            logits = self.lm(input_ids=ids, attention_mask=mask).logits[source].float()
            if temperatures is not None:
                logits = logits / temperatures[:, None]
            picked = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
            shifted = torch.zeros(real.shape, dtype=picked.dtype, device=input_ids.device)
            return torch.nn.functional.pad(shifted.masked_scatter(real, picked), (1, 0))
        decoder = self.lm.get_decoder()
        cut = None
        if self.share_heads and rows is not None and loss_mask is not None:
            cut = shared_heads(ids, rows, loss_mask)
        if cut is None:
            hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
            states = hidden[source]
        else:
            hidden = _run_heads(decoder, cut)
            states = hidden[source[0], source[1] - cut.split[source[0]]]
        head = self.lm.get_output_embeddings()
        pieces = []
        for start in range(0, states.shape[0], self.chunk_tokens):
            end = start + self.chunk_tokens
            h, t = states[start:end], targets[start:end]
            tt = None if temperatures is None else temperatures[start:end]
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_chunk_logprobs, head, h, t, tt, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(head, h, t, tt))
        shifted = torch.zeros(real.shape, dtype=torch.float32, device=input_ids.device)
        if not pieces:  # no position to score (an empty micro-batch): still one through the head, so
            # that a backward pass reaches every parameter as it does on the other ranks
            first = _chunk_logprobs(head, hidden[:, 0], ids[:, 0]).sum() * 0.0
            return torch.nn.functional.pad(shifted, (1, 0)) + first
        shifted = shifted.masked_scatter(real, torch.cat(pieces))
        return torch.nn.functional.pad(shifted, (1, 0))


def policy_logprobs(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """`StepRunner`'s log-prob function for a `PolicyLogprobs` model (plain or sharded)."""
    out: torch.Tensor = model(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperature)
    return out
