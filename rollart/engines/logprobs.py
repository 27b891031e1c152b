"""Token log-probs of a causal LM without the whole `[N, T, V]` logits in memory.

`PolicyLogprobs` wraps a Hugging Face causal LM as the module a training engine runs: its forward
takes token ids and attention mask and returns each token's log-prob given the tokens before it
(`[N, T]` float32, 0 at t = 0 and on padding). With `chunk_tokens > 0` it runs the decoder once,
then the output head on at most `chunk_tokens` real positions at a time, keeping only each
position's log-sum-exp and target logit: in a backward pass each chunk is recomputed
(`torch.utils.checkpoint`), so at most one chunk's logits ever exist. At Qwen3's 151,936-token
vocabulary the fp32 logits of 16 rows of 1,024 tokens alone are 10 GB; a 1,024-token chunk is 0.6 GB.

Being the module FSDP2 shards at its root, the wrapper's forward runs with the root's parameters
(embeddings, final norm, output head) gathered; calling the decoder and head from outside it would
bypass FSDP2's hooks. The output head is the model's `get_output_embeddings()` applied to the
decoder's last hidden state, which is the whole head for Qwen, Qwen2.5 and Llama families; models
that scale or soft-cap logits after the head (Gemma 2) need `chunk_tokens: 0`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rollart.algorithms.grpo import token_logprobs


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = head(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class PolicyLogprobs(torch.nn.Module):
    """A causal LM whose forward returns token log-probs (module docstring)."""

    def __init__(self, lm: Any, *, chunk_tokens: int = 0) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        real = attention_mask[:, 1:] > 0
        if self.chunk_tokens <= 0:
            logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits
            full = token_logprobs(logits, input_ids)
            return full * torch.nn.functional.pad(real, (1, 0)).to(full.dtype)
        hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = self.lm.get_output_embeddings()
        states, targets = hidden[:, :-1][real], input_ids[:, 1:][real]
        pieces = []
        for start in range(0, states.shape[0], self.chunk_tokens):
            h, t = states[start : start + self.chunk_tokens], targets[start : start + self.chunk_tokens]
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(head, h, t))
        shifted = torch.zeros(real.shape, dtype=torch.float32, device=input_ids.device)
        if not pieces:  # no position to score (an empty micro-batch): still one through the head, so
            # that a backward pass reaches every parameter as it does on the other ranks
            first = _chunk_logprobs(head, hidden[:, 0], input_ids[:, 0]).sum() * 0.0
            return torch.nn.functional.pad(shifted, (1, 0)) + first
        shifted = shifted.masked_scatter(real, torch.cat(pieces))
        return torch.nn.functional.pad(shifted, (1, 0))


def policy_logprobs(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """`StepRunner`'s log-prob function for a `PolicyLogprobs` model (plain or sharded)."""
    out: torch.Tensor = model(batch.input_ids, batch.attention_mask)
    return out
