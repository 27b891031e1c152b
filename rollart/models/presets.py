"""The public shapes of the Qwen3 dense family, by name, for sizing a topology before its weights are there.

`run.model.shape: qwen3-8b` in a topology lets `rollart check` size every node for Qwen3-8B while
`run.model.path` is still empty (a checkpoint's own config.json wins once it is there). The values are
those of each model's published `config.json` (Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B): head_dim 128,
vocabulary 151,936, 40,960 positions, bfloat16, per-head q/k RMSNorm, no attention biases; the
embeddings are tied up to 4B and not from 8B on. Their parameter counts (`ModelShape.params`)
match the model cards' 0.6B, 1.7B, 4.0B, 8.2B, 14.8B and 32.8B (tests/unit/test_sizing.py).
"""

from __future__ import annotations

import difflib

from rollart.models.shapes import ModelShape


def _qwen3(name: str, *, hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> ModelShape:
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        tied_embeddings=tied,
        max_position_embeddings=40960,
        dtype="bfloat16",
        qk_norm=True,
    )


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        _qwen3("qwen3-0.6b", hidden=1024, intermediate=3072, layers=28, heads=16, tied=True),
        _qwen3("qwen3-1.7b", hidden=2048, intermediate=6144, layers=28, heads=16, tied=True),
        _qwen3("qwen3-4b", hidden=2560, intermediate=9728, layers=36, heads=32, tied=True),
        _qwen3("qwen3-8b", hidden=4096, intermediate=12288, layers=36, heads=32, tied=False),
        _qwen3("qwen3-14b", hidden=5120, intermediate=17408, layers=40, heads=40, tied=False),
        _qwen3("qwen3-32b", hidden=5120, intermediate=25600, layers=64, heads=64, tied=False),
    )
}
"""`run.model.shape` -> the model's shape."""


def preset(name: str) -> ModelShape | None:
    """The preset called `name` (any case: `Qwen3-8B` is `qwen3-8b`), or None."""
    return PRESETS.get(name.lower())


def unknown_preset(name: str) -> str:
    """The problem to report for a `run.model.shape` that names no preset: the known names and a hint."""
    hint = difflib.get_close_matches(name.lower(), PRESETS, n=1)
    known = ", ".join(PRESETS)
    return f"unknown model shape {name!r} (known: {known})" + (f"; did you mean {hint[0]!r}?" if hint else "")
