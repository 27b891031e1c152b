"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollart.testkit.ports import free_ports


@pytest.fixture
def free_port() -> int:
    """A loopback TCP port that was free a moment ago (bound to port 0, then released)."""
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (tests/unit/test_tiny_model.py), built once per test module."""
    from rollart.tiny.model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-shaped BPE test model (`rollart build-model --preset qwen3-bpe`), built once per test session."""
    from rollart.models.qwen3_bpe import build_qwen3_bpe_model

    return build_qwen3_bpe_model(tmp_path_factory.mktemp("qwen3-bpe") / "model", seed=0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op torch thread while the test runs: the tiny model's matmuls gain nothing from
    more, and on a busy machine spinning threads made training 3-4x slower. Restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
