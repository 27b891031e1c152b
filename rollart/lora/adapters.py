"""LoRA adapters (`run.trainer.lora`): putting them on a policy with PEFT, naming them, merging and writing them.

The trainer side (`rollart.training.torch.engine`, `rollart.training.fsdp.rank`) calls `apply_lora` on the
Hugging Face model it loaded: PEFT replaces each targeted linear layer in place by one that holds the
frozen base weight (`...q_proj.base_layer.weight`) and the two adapter matrices (`...q_proj.lora_A.default.weight`
[rank, in], `...q_proj.lora_B.default.weight` [out, rank]); every other weight is frozen. The adapters
leave the engine (`export_weights`, checkpoints, the weight push) under the names of PEFT's saved-adapter
format, `base_model.model.<module>.lora_A.weight`, which `peft.PeftModel.from_pretrained` and vLLM's LoRA
loader both read (`peft_name`).

The generator side uses the pure functions over tensors and a `LoraSpec`: `adapter_base_names` (the
Hugging Face weights the adapters modify), `merge_adapters` (those weights with the adapters folded in,
W + alpha / rank x B @ A), and `write_peft_adapter` (a PEFT adapter folder, for a vLLM `LoRARequest`).

Imports torch and peft: import it only where LoRA is used.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollart.errors import ConfigError

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

    from rollart.lora.spec import LoraSpec

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter settings file."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter weights file."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's saved names put before a module's name in the wrapped model."""
ADAPTER_NAME = "default"
"""The one adapter a policy carries (PEFT's default name; it is left out of the saved names)."""
PARTS = ("lora_A", "lora_B")


# -- building the policy ------------------------------------------------------------------------


def lora_config(spec: LoraSpec, base_model_path: str | Path | None = None) -> LoraConfig:
    """PEFT's settings for `spec` (a causal LM; no bias trained)."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # typed int; PEFT divides it by r as a float
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=None if base_model_path is None else str(base_model_path),
    )


def linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's linear layers by module name (what `target_modules` may name)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _matches(module_name: str, target: str) -> bool:
    """PEFT's rule: a target names a module by its whole name or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def check_targets(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Raise ConfigError (naming the YAML path) when a target module matches no linear layer of `model`,
    or when `spec.rank` exceeds a targeted layer's smaller dimension (B @ A would not be low-rank)."""
    linear = linear_modules(model)
    known = sorted({name.rsplit(".", 1)[-1] for name in linear})
    for target in spec.target_modules:
        hits = [name for name in linear if _matches(name, target)]
        if not hits:
            raise ConfigError(
                f"run.trainer.lora.target_modules: {target!r} names no linear module of the model "
                f"(its linear modules: {', '.join(known)})"
            )
        for name in hits:
            smaller = min(linear[name].in_features, linear[name].out_features)
            if spec.rank > smaller:
                raise ConfigError(
                    f"run.trainer.lora.rank: {spec.rank} is larger than {name}'s smaller dimension "
                    f"({linear[name].in_features} -> {linear[name].out_features}); use a rank <= {smaller}"
                )


def check_model_targets(model_path: str | Path, spec: LoraSpec) -> None:
    """`check_targets` on the model of `model_path`'s config, built on the meta device (no memory, no
    weights read): for engines whose ranks build the model in other processes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    check_targets(model, spec)


def apply_lora(lm: torch.nn.Module, spec: LoraSpec) -> PeftModel:
    """Put adapters on `lm` in place (its targeted layers replaced, every base weight frozen) and return
    PEFT's wrapper of it. Adapters are fp32 whatever the base's dtype; lora_B starts at zero, so the
    policy starts as the base. Raises ConfigError for targets `check_targets` refuses."""
    from peft import PeftModel, get_peft_model

    check_targets(lm, spec)
    model = get_peft_model(lm, lora_config(spec), adapter_name=ADAPTER_NAME, autocast_adapter_dtype=True)
    assert isinstance(model, PeftModel)
    return model


# -- names ----------------------------------------------------------------------------------------


def is_adapter(name: str) -> bool:
    """Whether a parameter name of a model `apply_lora` changed is an adapter matrix."""
    return any(f".{part}.{ADAPTER_NAME}." in name for part in PARTS)


def peft_name(name: str) -> str:
    """An adapter's name in the model (`model.layers.0.self_attn.q_proj.lora_A.default.weight`, with or
    without a wrapper's prefix before it such as `lm.`) -> PEFT's saved name for it
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), given the model's own names."""
    for part in PARTS:
        name = name.replace(f".{part}.{ADAPTER_NAME}.", f".{part}.")
    return PEFT_PREFIX + name


def adapter_parameters(lm: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter matrices of `lm` (the Hugging Face model `apply_lora` changed), by their names in it."""
    return [(name, param) for name, param in lm.named_parameters() if is_adapter(name)]


def adapter_state(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live adapter tensors of `lm` by PEFT's saved names (`peft_name`); under FSDP2, DTensors."""
    return {peft_name(name): tensor for name, tensor in lm.state_dict().items() if is_adapter(name)}


def _split(name: str) -> tuple[str, str]:
    """A PEFT saved name -> (the targeted module's Hugging Face name, lora_A or lora_B)."""
    if not name.startswith(PEFT_PREFIX) or not name.endswith(".weight"):
        raise ValueError(f"{name!r} is not an adapter weight in PEFT's format ({PEFT_PREFIX}<module>.lora_A.weight)")
    module, part = name[len(PEFT_PREFIX) : -len(".weight")].rsplit(".", 1)
    if part not in PARTS:
        raise ValueError(f"{name!r} is neither a lora_A nor a lora_B weight")
    return module, part


def adapter_base_names(adapters: Iterable[str]) -> list[str]:
    """The Hugging Face weight names (`model.layers.0.self_attn.q_proj.weight`) the adapters named in
    PEFT's format modify, each once, in the adapters' order."""
    return list(dict.fromkeys(_split(name)[0] + ".weight" for name in adapters))


# -- merging and writing ------------------------------------------------------------------------


def merge_adapters(
    base_state: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], spec: LoraSpec
) -> dict[str, torch.Tensor]:
    """The weights of the modules the adapters target, by Hugging Face name, with the adapters folded in:
    W + spec.scaling * B @ A, computed in fp32 on W's device and cast back to W's dtype. `base_state` holds
    the base weights by Hugging Face name (at least those `adapter_base_names` gives); `adapters` is what
    the trainer exports (PEFT's names). Raises ValueError when an adapter lacks its pair or its base
    weight, or the shapes do not fit."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        module, part = _split(name)
        pairs.setdefault(module, {})[part] = tensor
    merged = {}
    for module, pair in pairs.items():
        weight_name = module + ".weight"
        if set(pair) != set(PARTS):
            raise ValueError(f"{module}: the adapters hold {sorted(pair)}, not both lora_A and lora_B")
        if weight_name not in base_state:
            raise ValueError(f"{module}: no base weight {weight_name!r} to merge the adapter into")
        weight = base_state[weight_name]
        a, b = (pair[part].to(weight.device, torch.float32) for part in PARTS)
        if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"{module}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit the weight {tuple(weight.shape)}"
            )
        merged[weight_name] = (weight.float() + spec.scaling * (b @ a)).to(weight.dtype)
    return merged


def write_peft_adapter(
    folder: str | Path, adapters: Mapping[str, torch.Tensor], spec: LoraSpec, base_model_path: str | Path
) -> Path:
    """Write `adapters` (PEFT's names, as pushed) as a PEFT adapter folder: `adapter_config.json` and
    `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, folder)` and vLLM's
    `LoRARequest` load. The tensors are written in their own dtype. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = lora_config(spec, base_model_path).to_dict()  # type: ignore[no-untyped-call]
    config["target_modules"] = sorted(spec.target_modules)  # a set in PEFT's dict: not JSON
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in adapters.items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return folder


def read_peft_adapter(folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT adapter folder, by PEFT's names."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / ADAPTER_WEIGHTS))


def spec_dict(spec: LoraSpec) -> dict[str, Any]:
    """`spec` as plain data (for a checkpoint's engine.json)."""
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(spec)
    return out
