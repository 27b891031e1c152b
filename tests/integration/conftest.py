"""Fixtures of the integration tests that start a small training topology (tests/integration/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    """Clusters a test makes (`make_cluster`); their nodes are stopped however the test ends."""
    made: list[Cluster] = []
    try:
        yield made
    finally:
        for cluster in made:
            cluster.stop()
