"""Loading a Hugging Face causal-LM folder (config + safetensors + tokenizer) from disk, never from the network."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_model_and_tokenizer(
    path: Path | str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any Hugging Face causal-LM folder (config + safetensors + tokenizer) from disk, never from the network.

    The model comes back in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model = model.to(device).eval()  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tokenizer
