"""A LoRA version pushed the way a run pushes it: the real `WeightPublisher` -> `WeightReceiver` over loopback TCP,
into the transformers engine's `load_adapter`. Only the adapters travel (the receiver's payload bytes are exactly
the adapters' bytes; the whole model's are printed beside them), and the engine's greedy output afterwards is that
of the base with the adapters merged by PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollart.generation.engine import SamplingParams
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import PROMPTS, build_engine_test_model, hf_greedy
from tests.lora_reference import SPEC, adapter_bytes, peft_adapters
from tests.weight_push import push_over_tcp

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


@pytest.mark.timeout(120)
async def test_lora_push_carries_only_the_adapters_and_the_engine_then_decodes_as_the_merged_model(
    tmp_path: Path,
) -> None:
    model_dir = build_engine_test_model(tmp_path / "model")
    base, tokenizer = load_model_and_tokenizer(model_dir)
    adapters, merged = peft_adapters(model_dir, seed=3, scale=0.3)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    engine = HFEngine(model_dir)
    await engine.start()
    try:

        async def apply(version: int, pushed: dict[str, torch.Tensor]) -> None:
            await engine.load_adapter(version, pushed, SPEC)

        stats = await push_over_tcp(apply, 1, adapters)
        outputs = [
            await engine.generate(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0))
            for i, p in enumerate(prompts)
        ]
    finally:
        await engine.close()

    sent = adapter_bytes(adapters)
    # What a full push of this model sends: every tensor once (the tied lm_head goes with the embeddings).
    unique = {tensor.untyped_storage().data_ptr(): tensor for tensor in base.state_dict().values()}
    whole = sum(tensor.numel() * tensor.element_size() for tensor in unique.values())
    assert stats.version == 1 and stats.applied == 1
    assert stats.bytes_received == stats.bytes_decoded == sent, (stats, sent)
    assert sent < whole / 10
    assert [out.token_ids for out in outputs] == [hf_greedy(merged, p, 16) for p in prompts]
    assert all(out.versions == [1] * len(out.token_ids) for out in outputs)
    print(f"\nLoRA push: {sent:,} adapter bytes received ({len(adapters)} tensors); the whole model is {whole:,} bytes")


@pytest.mark.timeout(120)
async def test_lora_the_trainers_adapters_pushed_decode_as_the_trainers_exported_merged_model(tmp_path: Path) -> None:
    """End to end: the torch trainer trains adapters, its `export_weights` is pushed into the engine, and the
    engine's greedy output equals that of the merged model `rollart export` writes from the trainer's checkpoint."""
    from transformers import AutoModelForCausalLM

    from rollart.testkit.batches import random_batch
    from rollart.training.export import export_checkpoint
    from rollart.training.spec import TrainerSpec
    from rollart.training.torch.engine import TorchTrainer

    model_dir = build_engine_test_model(tmp_path / "model")
    spec = TrainerSpec(device="cpu", lr=5e-2, micro_batch_size=4, threads=1, lora=SPEC)
    trainer = TorchTrainer(model_dir, spec, seed=0)
    for version in (1, 2):
        trainer.train_step(random_batch(version, rows=8), version=version)
    trainer.save(tmp_path / "step-2").result()
    export_checkpoint(tmp_path / "step-2", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
    _, tokenizer = load_model_and_tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    base_outputs = [hf_greedy(load_model_and_tokenizer(model_dir)[0], p, 16) for p in prompts]
    engine = HFEngine(model_dir)
    await engine.start()
    try:

        async def apply(version: int, pushed: dict[str, torch.Tensor]) -> None:
            await engine.load_adapter(version, pushed, SPEC)

        stats = await push_over_tcp(apply, 2, trainer.export_weights())
        greedy = SamplingParams(max_tokens=16, temperature=0)
        outputs = [(await engine.generate(f"r{i}", p, greedy)).token_ids for i, p in enumerate(prompts)]
    finally:
        await engine.close()
        trainer.close()
    assert stats.bytes_received == adapter_bytes(trainer.export_weights())
    assert outputs == [hf_greedy(merged, p, 16) for p in prompts]
    assert outputs != base_outputs  # the adapters changed what the model says
