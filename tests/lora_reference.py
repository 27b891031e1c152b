"""What the LoRA generator tests compare against: adapters made by PEFT itself on a base model, as a trainer
would push them after a few steps (lora_B no longer zero), and the model PEFT merges them into."""

from __future__ import annotations

from pathlib import Path

import torch

from rollart.lora.spec import LoraSpec
from rollart.models.loading import load_model_and_tokenizer

SPEC = LoraSpec(rank=4, alpha=8.0)
"""q, k, v and o projections, scaling 2."""


def peft_adapters(
    base: Path, spec: LoraSpec = SPEC, *, seed: int, scale: float = 0.5
) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Adapters on `base` by PEFT's saved names (`get_peft_model_state_dict`), lora_A as PEFT initialises it and
    lora_B drawn from N(0, scale^2) under `seed`; and the base with them merged by PEFT (`merge_and_unload`)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    model, _ = load_model_and_tokenizer(base)
    torch.manual_seed(seed)  # lora_A's initialisation
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules))  # type: ignore[arg-type]
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    adapters = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(peft_model).items()}
    merged = peft_model.merge_and_unload()
    assert isinstance(merged, torch.nn.Module)
    return adapters, merged


def adapter_bytes(adapters: dict[str, torch.Tensor]) -> int:
    """What the adapters' tensors hold: numel x element size, summed."""
    return sum(tensor.numel() * tensor.element_size() for tensor in adapters.values())
