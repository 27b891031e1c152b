"""Fixtures of the integration tests that start a small training topology (tests/integration/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.cluster import Cluster


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    """Clusters a test makes (`make_cluster`); their nodes are stopped however the test ends."""
    made: list[Cluster] = []
    try:
        yield made
    finally:
        for cluster in made:
            cluster.stop()
