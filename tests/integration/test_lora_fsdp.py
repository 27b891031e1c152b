"""LoRA on the FSDP2 backend on CPU (gloo, two real rank processes) against the torch backend with LoRA.

Each rank puts PEFT's adapters on its model before `fully_shard`, which then shards frozen base weights
and trainable adapters in the same groups: two ranks must train like one device (loss, gradient norm,
exported adapters to 1e-5), holding optimizer state for the adapters alone; the export is the adapters
alone by PEFT's names; a checkpoint holds the adapters (not the base), resumes onto another rank count,
and `rollart export` turns it into the merged model or the adapter folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from torch.distributed.checkpoint.filesystem import FileSystemReader
from transformers import AutoModelForCausalLM

from rollart.errors import RollartError
from rollart.lora.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rollart.lora.spec import LoraSpec
from rollart.models.loading import load_model_and_tokenizer
from rollart.testkit.batches import grouped_batch, random_batch
from rollart.training.export import export_checkpoint
from rollart.training.fsdp.engine import FSDPTrainer
from rollart.training.spec import TrainerSpec
from rollart.training.torch.engine import TorchTrainer
from tests.integration import test_fsdp
from tests.integration.test_fsdp import relative

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])
SPEC: dict[str, Any] = test_fsdp.SPEC | {"lora": LORA}


def fsdp(model: Path, ranks: int, **spec: Any) -> FSDPTrainer:
    return test_fsdp.fsdp(model, ranks, **({"lora": LORA} | spec))


def test_lora_fsdp_two_ranks_train_like_the_torch_backend(tiny_model: Path, tmp_path: Path) -> None:
    single = TorchTrainer(tiny_model, TrainerSpec(**SPEC), seed=0)
    sharded = fsdp(tiny_model, 2)
    try:
        assert sharded.describe()["trainable_parameters"] == single.describe()["trainable_parameters"]
        for step in range(3):
            batch = random_batch(step, rows=7) if step < 2 else grouped_batch()
            one, two = single.train_step(batch, version=4), sharded.train_step(batch, version=4)
            for key in ("loss", "grad_norm", "policy_loss", "importance_ratio_mean", "tokens"):
                assert two[key] == pytest.approx(one[key], rel=1e-5), (step, key)
        weights, expected = sharded.export_weights(), single.export_weights()
        assert list(weights) == list(expected) and all("lora_" in name for name in weights)
        for name, tensor in expected.items():
            assert weights[name].dtype == tensor.dtype and relative(weights[name], tensor) < 1e-5, name
        assert {t.dtype for t in sharded.export_weights(torch.bfloat16).values()} == {torch.bfloat16}
        state = sharded.full_state()
        adapters = [name for name in state["model"] if "lora_" in name]
        assert len(state["optim"]["state"]) == len(adapters) == 24  # AdamW state for the adapters alone
        sharded.save(tmp_path / "ckpt").result(timeout=60)
    finally:
        sharded.close()
    # the shards hold the adapters and their optimizer state, not the frozen base
    entries = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_entries = [key for key in entries if key.startswith("model.")]
    assert len(model_entries) == 24 and all(".lora_" in key for key in model_entries)
    tensor_bytes = sum(m.size.numel() * m.properties.dtype.itemsize for m in entries.values() if hasattr(m, "size"))
    assert tensor_bytes == 3 * sum(t.numel() * t.element_size() for t in expected.values()) + 4 * 24
    one_rank = fsdp(tiny_model, 1)
    try:
        one_rank.load(tmp_path / "ckpt")
        resumed = one_rank.export_weights()
        for name, tensor in weights.items():
            assert torch.equal(resumed[name], tensor), name
        batch = random_batch(5, rows=6)
        a, b = one_rank.train_step(batch, version=5), single.train_step(batch, version=5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # optimizer state came back too
    finally:
        one_rank.close()
    full = fsdp(tiny_model, 1, lora=None)
    try:
        with pytest.raises(RollartError, match=r"run\.trainer\.lora must be set"):
            full.load(tmp_path / "ckpt")
    finally:
        full.close()
    adapter_dir = export_checkpoint(tmp_path / "ckpt", tmp_path / "adapter", adapters=True)
    assert sorted(p.name for p in adapter_dir.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    merged_dir = export_checkpoint(tmp_path / "ckpt", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), local_files_only=True)
    base, _ = load_model_and_tokenizer(tiny_model)
    reference = PeftModel.from_pretrained(base, str(adapter_dir))
    ids = torch.tensor([[5, 70, 71, 72, 6, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_fsdp_on_a_bf16_base_shards_bf16_and_fp32_together(tiny_model: Path) -> None:
    """A bf16 base and fp32 adapters in the same `fully_shard` groups: trains like the torch backend's bf16 LoRA."""
    lora = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj"], base_dtype="bf16")
    single = TorchTrainer(tiny_model, TrainerSpec(**(SPEC | {"lora": lora})), seed=0)
    sharded = fsdp(tiny_model, 2, lora=lora)
    try:
        for step in range(2):
            batch = random_batch(20 + step, rows=6)
            one, two = single.train_step(batch, version=2), sharded.train_step(batch, version=2)
            assert two["loss"] == pytest.approx(one["loss"], rel=1e-3), step
            assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-2), step
        weights = sharded.export_weights()
        assert {t.dtype for t in weights.values()} == {torch.float32} and len(weights) == 16
    finally:
        sharded.close()
