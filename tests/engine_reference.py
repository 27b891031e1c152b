"""What the engine tests of every backend compare against: a perturbed tiny model and HF's own generate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rollart.models.loading import load_model_and_tokenizer
from rollart.tiny.model import ensure_tiny_model

EOS = 1
PROMPTS = ["hello world", "abc", "The quick brown fox jumps", "<|im_start|>user\n2+2?<|im_end|>\n", "x"]


def noisy_weights(model: torch.nn.Module, *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise, without the tied `lm_head.weight` (as a trainer would send them)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }


def build_engine_test_model(folder: Path) -> Path:
    """The tiny model with its weights shaken up (freshly initialised, greedy decoding only repeats one character)
    and EOS's (tied) embedding zeroed: its logit is then always 0, below the best of 100 others, so greedy decoding
    never ends on its own and a long request is surely still running when a test aborts it."""
    ensure_tiny_model(folder, seed=0)
    model, _ = load_model_and_tokenizer(folder)
    weights = noisy_weights(model, seed=1, scale=0.1)
    weights["model.embed_tokens.weight"][EOS] = 0.0
    model.load_state_dict(weights, strict=False)
    model.save_pretrained(folder)
    return folder


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """HF's own greedy generate: what an engine's greedy output must equal."""
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
        )
    return list(out[0, len(prompt) :].tolist())


def encoded_prompts(model_dir: Path, texts: list[str] = PROMPTS) -> list[list[int]]:
    """`texts` as the model's tokenizer encodes them."""
    _, tokenizer = load_model_and_tokenizer(model_dir)
    return [tokenizer.encode(text) for text in texts]


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for what another process does (tokens vLLM generates): poll, bounded."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.005)


def with_weights(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model of `model_dir` holding `weights` (a tied lm_head follows the embeddings): what an engine given
    them must decode like."""
    model, _ = load_model_and_tokenizer(model_dir)
    model.load_state_dict(weights, strict=False)
    return model


async def generate_all(engine: Any, prompts: list[list[int]], tag: str, params: Any) -> list[Any]:
    """Every prompt as its own concurrent request (ids `tag0`, `tag1`, ...); the results in prompt order."""
    return await asyncio.gather(*(engine.generate(f"{tag}{i}", p, params) for i, p in enumerate(prompts)))


async def importance_ratios(
    engine: Any, model_dir: Path, prompts: list[list[int]], *, temperature: float, trainer_temperature: float
) -> torch.Tensor:
    """exp(trainer log-prob - behaviour log-prob) of every token `engine` samples at `temperature` (8 tokens per
    prompt, 4 samples of each), the trainer's taken as a training step takes them (`pack_batch`, then
    `PolicyLogprobs` on the same weights, chunked head) at `trainer_temperature`: all 1 when the two agree."""
    from rollart.algorithms.grpo import pack_batch
    from rollart.generation.engine import SamplingParams
    from rollart.testkit.batches import Seq
    from rollart.training.logprobs import PolicyLogprobs, policy_logprobs

    params = SamplingParams(max_tokens=8, temperature=temperature)
    results = await generate_all(engine, [p for p in prompts for _ in range(4)], "t", params)
    sequences = [
        Seq(prompt, r.token_ids, [1] * len(r.token_ids), r.logprobs, [0] * len(r.token_ids))
        for prompt, r in zip([p for p in prompts for _ in range(4)], results, strict=True)
    ]
    batch = pack_batch(sequences, [1.0] * len(sequences), pad_id=0, temperature=trainer_temperature)
    model, _ = load_model_and_tokenizer(model_dir)
    with torch.no_grad():
        trainer = policy_logprobs(PolicyLogprobs(model.float(), chunk_tokens=7), batch)
    loss = batch.loss_mask > 0
    return (trainer[loss] - batch.behaviour_logprobs[loss]).exp()
