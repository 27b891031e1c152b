"""New weights for a running vLLM engine: checked against the checkpoint it loaded, then staged as safetensors.

vLLM reloads weights from a folder (`reload_weights`), so an update is written there as one safetensors file. The
check is `rollart.engines.checks.check_weights` against the names and shapes of the model folder's checkpoint.
With tied embeddings vLLM keeps its own `lm_head.weight` unless one is sent, so a copy of the embeddings is sent
when the update leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rollart.engines.checks import check_weights

if TYPE_CHECKING:
    import torch

_TIED_NAME = "lm_head.weight"
_EMBED_NAME = "model.embed_tokens.weight"


def checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model folder's safetensors files (headers only); empty if there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    return shapes


def tied_aliases(tied: bool, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """{lm_head: embeddings} when the model ties them (config `tie_word_embeddings`) and has the embeddings."""
    return {_TIED_NAME: _EMBED_NAME} if tied and _EMBED_NAME in shapes else {}


def checked_tensors(
    version: int,
    weights: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """Check names and shapes against the checkpoint the engine loaded; add the tied lm_head; CPU copies."""
    import torch

    check_weights(version, weights, shapes, aliases, equal=torch.equal)
    # safetensors wants contiguous CPU tensors that share no storage (the tied pair included).
    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights.items()}
    for alias, name in aliases.items():
        if alias not in tensors:
            tensors[alias] = tensors[name].clone()
    return tensors


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
