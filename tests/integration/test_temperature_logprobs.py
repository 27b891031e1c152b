"""The trainer's log-probs are those of the distribution the generator sampled from: at `rollout.sampling.temperature`
0.7 the transformers engine samples from softmax(logits / 0.7) and reports those log-probs, and the trainer divides
its logits by the same temperature (`pack_batch(temperature=)`, `PolicyLogprobs`), so on tokens sampled from its
own weights every importance ratio is 1. Before, the trainer scored the untempered logits: ratios up to ~1.8 at
zero staleness (the same check against vLLM: tests/slow/test_vllm_engine.py -k temperature_logprobs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollart.generation.hf.engine import HFEngine
from tests.engine_reference import build_engine_test_model, encoded_prompts, importance_ratios

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("temperature") / "model")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[HFEngine]:
    engine = HFEngine(model_dir, max_batch_size=32)
    await engine.start()
    yield engine
    await engine.close()


async def test_temperature_logprobs_of_the_trainer_match_the_hf_engines_sampling_at_0_7(
    engine: HFEngine, model_dir: Path
) -> None:
    prompts = encoded_prompts(model_dir)
    ratios = await importance_ratios(engine, model_dir, prompts, temperature=0.7, trainer_temperature=0.7)
    assert abs(ratios.mean().item() - 1) <= 0.01 and ratios.max().item() < 1.1, (ratios.mean(), ratios.max())
    print(f"ratio at 0.7 over {ratios.numel()} tokens: mean {ratios.mean():.5f} max {ratios.max():.5f}")


async def test_temperature_logprobs_ignored_by_the_trainer_bias_the_ratio(engine: HFEngine, model_dir: Path) -> None:
    """What the check above catches: scoring the untempered logits (the code before) puts ratios far from 1."""
    prompts = encoded_prompts(model_dir)
    ignored = await importance_ratios(engine, model_dir, prompts, temperature=0.7, trainer_temperature=1.0)
    assert ignored.max().item() > 1.1, ignored.max()
