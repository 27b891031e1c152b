"""LoRA in the torch training engine (`run.trainer.lora`), with PEFT, on the tiny model.

The base is frozen and AdamW holds state for the adapters alone; the engine exports the adapters
alone under PEFT's saved names; `rollart.lora.adapters` merges them as PEFT's `merge_and_unload`
does and writes a PEFT adapter folder that `PeftModel.from_pretrained` loads to the same outputs;
a checkpoint holds the adapters and resumes exactly; `rollart export` writes the merged model or
(`--adapters`) the adapter folder; bad targets and ranks are refused naming the YAML path; a bf16
base keeps fp32 adapters; pi_prox is computed without dropout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart.cli import main as cli_main
from rollart.errors import ConfigError, RollartError
from rollart.lora.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base_names,
    merge_adapters,
    write_peft_adapter,
)
from rollart.lora.spec import LoraSpec
from rollart.models.loading import load_model_and_tokenizer
from rollart.testkit.batches import random_batch, synthetic_batch
from rollart.training.export import export_checkpoint
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec
from rollart.training.torch.engine import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def lora_trainer(model: Path, lora: LoraSpec = LORA, **spec: Any) -> TorchTrainer:
    base: dict[str, Any] = {"lr": 1e-2, "micro_batch_size": 2, "device": "cpu", "lora": lora}
    return TorchTrainer(model, TrainerSpec(**(base | spec)), seed=0)


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


IDS = torch.tensor([[5, 70, 71, 72, 6, 40, 41], [5, 80, 81, 6, 50, 51, 3]])


def test_lora_optimizer_holds_the_adapters_alone_and_the_base_stays_frozen(tiny_model: Path) -> None:
    engine = lora_trainer(tiny_model)
    adapters = {name: p for name, p in engine.lm.named_parameters() if "lora_" in name}
    assert len(adapters) == 4 * 3 * 2  # 4 layers x 3 targets x (A, B)
    grouped = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in grouped} == {id(p) for p in adapters.values()} and len(grouped) == len(adapters)
    base_before = {name: t.clone() for name, t in engine.lm.state_dict().items() if "lora_" not in name}
    stats = [engine.train_step(synthetic_batch(), version=4) for _ in range(2)]
    assert all(s["grad_norm"] > 0 for s in stats) and stats[1]["loss"] != stats[0]["loss"]
    for name, tensor in engine.lm.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(tensor, base_before[name]), name
    assert any(p.abs().sum() > 0 for name, p in adapters.items() if "lora_B" in name)  # B left zero: trained
    adapter_bytes = nbytes(adapters.values())
    optim_bytes = nbytes(v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    assert optim_bytes == 2 * adapter_bytes + 4 * len(adapters)  # exp_avg, exp_avg_sq, a float step each
    full = TorchTrainer(tiny_model, TrainerSpec(lr=1e-2, micro_batch_size=2, device="cpu"), seed=0)
    full_stats = full.train_step(synthetic_batch(), version=4)
    base_bytes = nbytes(engine.lm.parameters()) - adapter_bytes
    assert stats[0]["state_bytes_r0"] == base_bytes + 4 * adapter_bytes + 4 * len(adapters)
    assert stats[0]["state_bytes_r0"] < full_stats["state_bytes_r0"] / 3
    described = engine.describe()
    assert described["trainable_parameters"] == sum(p.numel() for p in adapters.values())


def test_lora_exports_the_adapters_alone_by_peft_names(tiny_model: Path) -> None:
    from peft import get_peft_model_state_dict

    engine = lora_trainer(tiny_model)
    engine.train_step(synthetic_batch(), version=4)
    weights = engine.export_weights()
    assert engine.peft_model is not None
    peft_state = get_peft_model_state_dict(engine.peft_model)
    assert list(weights) == list(peft_state)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in weights
    for name, tensor in peft_state.items():
        assert torch.equal(weights[name], tensor), name
    adapter_params = [p for name, p in engine.lm.named_parameters() if "lora_" in name]
    assert nbytes(weights.values()) == nbytes(adapter_params)
    halves = engine.export_weights(torch.bfloat16)
    assert {t.dtype for t in halves.values()} == {torch.bfloat16}
    assert nbytes(halves.values()) == nbytes(adapter_params) // 2
    assert engine.exports_copies(torch.bfloat16) and not engine.exports_copies(None)
    assert adapter_base_names(weights)[:3] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]


def test_lora_merge_adapters_equals_peft_merge_and_unload(tiny_model: Path) -> None:
    engine = lora_trainer(tiny_model)
    for step in range(2):
        engine.train_step(random_batch(step, rows=4), version=2)
    adapters = {name: t.clone() for name, t in engine.export_weights().items()}
    base, _ = load_model_and_tokenizer(tiny_model)
    merged = merge_adapters(base.state_dict(), adapters, LORA)
    assert sorted(merged) == sorted(adapter_base_names(adapters)) and len(merged) == 12
    assert engine.peft_model is not None
    reference = engine.peft_model.merge_and_unload().state_dict()
    for name, weight in merged.items():
        assert weight.dtype == torch.float32
        torch.testing.assert_close(weight, reference[name], rtol=1e-6, atol=1e-6, msg=name)
    halves = merge_adapters({n: t.to(torch.bfloat16) for n, t in base.state_dict().items()}, adapters, LORA)
    assert {t.dtype for t in halves.values()} == {torch.bfloat16}  # computed in fp32, cast back to W's
    with pytest.raises(ValueError, match="not both lora_A and lora_B"):
        merge_adapters(base.state_dict(), {next(iter(adapters)): next(iter(adapters.values()))}, LORA)


def test_lora_write_peft_adapter_round_trips_through_peft(tiny_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = lora_trainer(tiny_model)
    engine.train_step(synthetic_batch(), version=4)
    folder = write_peft_adapter(tmp_path / "adapter", engine.export_weights(), LORA, tiny_model)
    assert sorted(p.name for p in folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    base, _ = load_model_and_tokenizer(tiny_model)
    loaded = PeftModel.from_pretrained(base, str(folder))
    trained = logits(engine.lm.eval(), IDS)
    assert not torch.equal(trained, logits(load_model_and_tokenizer(tiny_model)[0], IDS))  # it moved
    torch.testing.assert_close(logits(loaded, IDS), trained, rtol=0, atol=0)


def test_lora_checkpoint_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    engine = lora_trainer(tiny_model)
    for step in range(2):
        engine.train_step(random_batch(step, rows=5), version=2)
    engine.save(tmp_path / "ckpt").result()
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "optimizer.pt", "engine.json", "config.json"} <= set(saved)
    assert "model.safetensors" not in saved  # the base is never rewritten
    engine_json = json.loads((tmp_path / "ckpt" / "engine.json").read_text())
    assert engine_json["lora"]["rank"] == 4 and engine_json["base_model"] == str(tiny_model.resolve())
    fresh = lora_trainer(tiny_model)
    fresh.load(tmp_path / "ckpt")
    assert fresh.steps == 2
    a, b = engine.train_step(random_batch(9, rows=5), version=3), fresh.train_step(random_batch(9, rows=5), version=3)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for name, tensor in engine.export_weights().items():
        assert torch.equal(tensor, fresh.export_weights()[name]), name
    full = TorchTrainer(tiny_model, TrainerSpec(device="cpu"), seed=0)
    with pytest.raises(RollartError, match=r"run.trainer.lora is not set"):
        full.load(tmp_path / "ckpt")
    full.save(tmp_path / "full").result()
    with pytest.raises(RollartError, match=r"full checkpoint, and run.trainer.lora is set"):
        fresh.load(tmp_path / "full")
    other = lora_trainer(tiny_model, LoraSpec(rank=4, target_modules=["k_proj"]))
    with pytest.raises(RollartError, match="not this engine's"):
        other.load(tmp_path / "ckpt")


def test_lora_export_merged_and_adapters(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = lora_trainer(tiny_model)
    for step in range(2):
        engine.train_step(random_batch(step, rows=4), version=2)
    engine.save(tmp_path / "ckpt").result()
    trained = logits(engine.lm.eval(), IDS)
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    command = ["export", str(tmp_path), str(merged_dir), "--checkpoint", str(tmp_path / "ckpt")]
    assert cli_main(command) == 0
    assert cli_main([*command[:2], str(adapter_dir), *command[3:], "--adapters"]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    assert sorted(p.name for p in adapter_dir.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert (merged_dir / "tokenizer.json").exists() and not (merged_dir / ADAPTER_CONFIG).exists()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), local_files_only=True)
    torch.testing.assert_close(logits(merged, IDS), trained, rtol=1e-5, atol=1e-5)
    base, _ = load_model_and_tokenizer(tiny_model)
    torch.testing.assert_close(logits(PeftModel.from_pretrained(base, str(adapter_dir)), IDS), trained)
    halves = export_checkpoint(tmp_path / "ckpt", tmp_path / "bf16", dtype="bf16", adapters=True)
    assert (halves / ADAPTER_WEIGHTS).stat().st_size < (adapter_dir / ADAPTER_WEIGHTS).stat().st_size
    full = TorchTrainer(tiny_model, TrainerSpec(device="cpu"), seed=0)
    full.save(tmp_path / "full").result()
    assert (
        cli_main(["export", str(tmp_path), str(tmp_path / "x"), "--checkpoint", str(tmp_path / "full"), "--adapters"])
        == 2
    )
    assert "trained every weight" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "fsdp2"])
def test_lora_bad_target_and_rank_are_refused_with_the_yaml_path(tiny_model: Path, backend: str) -> None:
    def build(lora: LoraSpec) -> None:
        build_training_engine(TrainerSpec(backend=backend, device="cpu", lora=lora), tiny_model, seed=0)

    with pytest.raises(ConfigError, match=r"run.trainer.lora.target_modules: 'qproj'.*q_proj, up_proj, v_proj"):
        build(LoraSpec(target_modules=["q_proj", "qproj"]))
    with pytest.raises(ConfigError, match=r"run.trainer.lora.rank: 100 .*k_proj's smaller dimension \(128 -> 64\)"):
        build(LoraSpec(rank=100, target_modules=["k_proj"]))


def test_lora_on_a_bf16_base_keeps_fp32_adapters(tiny_model: Path) -> None:
    targets = ["q_proj", "o_proj"]
    engine = lora_trainer(tiny_model, LoraSpec(rank=4, target_modules=targets, base_dtype="bf16"))
    fp32 = lora_trainer(tiny_model, LoraSpec(rank=4, target_modules=targets))
    dtypes = {("lora_" in name, p.dtype) for name, p in engine.lm.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    stats = [engine.train_step(synthetic_batch(), version=4) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor([s["loss"], s["grad_norm"]])).all() for s in stats)
    assert stats[1]["loss"] != stats[0]["loss"]
    # lora_B starts at zero: the first step's policy is the base, in bf16 or fp32 (bf16 rounding apart)
    assert stats[0]["loss"] == pytest.approx(fp32.train_step(synthetic_batch(), version=4)["loss"], rel=0.05)
    assert {t.dtype for t in engine.export_weights().values()} == {torch.float32}
    assert {p.dtype for group in engine.optimizer.param_groups for p in group["params"]} == {torch.float32}


def test_lora_dropout_is_off_where_the_step_computes_pi_prox(tiny_model: Path) -> None:
    from rollart.training.logprobs import policy_logprobs

    calls: list[tuple[bool, bool]] = []

    def recording(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls.append((torch.is_grad_enabled(), model.training))
        return policy_logprobs(model, batch)

    for dropout, prox_forwards in ((0.0, 1), (0.3, 2)):  # the second mini-batch's, and with dropout the first's
        engine = lora_trainer(tiny_model, LoraSpec(rank=4, dropout=dropout), updates_per_batch=2, micro_batch_size=8)
        engine.runner.logprobs = recording
        calls.clear()
        engine.train_step(synthetic_batch(), version=4)
        assert calls.count((False, False)) == prox_forwards, dropout  # no grad, in eval mode
        assert calls.count((True, True)) == 2 and len(calls) == prox_forwards + 2  # training: train mode
        assert engine.model.training
