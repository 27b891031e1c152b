"""What the vLLM engine tests share: the module's model outside any engine, what an engine must decode like.

Each module gives its own `model_dir` fixture (a model of its own, built once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollart.models.loading import load_model_and_tokenizer


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    model, _ = load_model_and_tokenizer(model_dir)
    return model
