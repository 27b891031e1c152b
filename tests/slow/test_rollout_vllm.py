"""A rollout-only run whose generator runs the vLLM backend, every node a real process.

Needs vLLM: run bin/setup-vllm, then `.venv-vllm/bin/python -m pytest tests/slow/test_rollout_vllm.py`
(CI does, in .ci/run); the nodes run with the same interpreter as the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.rundir import RunDir
from tests.integration.test_rollout import check_trajectory, run_to_completion
from tests.support import write_topology

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")
pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.mark.timeout(600)
def test_rollout_with_the_vllm_backend_collects_complete_groups(tmp_path: Path) -> None:
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "tiny", seed=0)
    rollout = f"""  model: {{path: {model}}}
  generator: {{backend: vllm}}
  reward_pool: {{min_workers: 1, max_workers: 1}}
  rollout:
    tasks:
      - {{name: lake, env: frozen-lake, max_turns: 3, max_tokens_per_turn: 12}}
      - {{name: reverse, env: copy-reverse, reward: exact-answer, max_tokens_per_turn: 40}}
    group_size: 2
    redundancy: 1
    batch_groups: 2
    steps: 2
    groups_per_env_host: 2
"""
    nodes = {"trainer": "trainer", "gen-0": "generator", "env-0": "env-host", "reward": "reward-gateway"}
    topology, _ = write_topology(tmp_path, nodes, extra_run=rollout)
    run_to_completion(topology, timeout=540)
    records = [json.loads(line) for line in RunDir(tmp_path / "run").rollout.read_text().splitlines()]
    assert len(records) == 2 * 2
    for record in records:
        assert len(record["group"]["trajectories"]) == 2
        for t in record["group"]["trajectories"]:
            check_trajectory(t)
            assert set(t["generators"]) == {"gen-0"}
    log = RunDir(tmp_path / "run").node_log("gen-0").read_text()
    assert '"backend": "vllm"' in log  # the generator really ran vLLM
