"""A rollout-only run whose generator runs the vLLM backend, every node a real process.

Needs vLLM: run bin/setup-vllm, then `.venv-vllm/bin/python -m pytest tests/slow/test_rollout_vllm.py`
(CI does, in .ci/run); the nodes run with the same interpreter as the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.rundir import RunDir
from tests.integration.test_rollout import check_trajectory, log_events, run_to_completion
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


@pytest.mark.timeout(600)
def test_disaggregated_rollout_prefills_on_one_vllm_generator_and_decodes_on_the_other(tmp_path: Path) -> None:
    """`rollout.routing: disaggregated` on real vLLM generators: every turn is prefilled on the compute generator,
    whose engine writes the prompt's KV cache to the KV store, and decoded on the bandwidth one, which reads it."""
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "tiny", seed=0)
    store = tmp_path / "kv-store"
    rollout = f"""  model: {{path: {model}}}
  generator: {{backend: vllm, kv_store: {store}}}
  reward_pool: {{min_workers: 1, max_workers: 1}}
  rollout:
    routing: disaggregated
    tasks:
      - {{name: lake, env: frozen-lake, max_turns: 3, max_tokens_per_turn: 12}}
    group_size: 2
    redundancy: 1
    batch_groups: 2
    steps: 2
    groups_per_env_host: 2
"""
    nodes = {"trainer": "trainer", "gen-c": "generator", "gen-b": "generator", "env-0": "env-host"}
    nodes["reward"] = "reward-gateway"
    hardware = {"gen-c": "compute", "gen-b": "bandwidth"}
    topology, _ = write_topology(tmp_path, nodes, extra_run=rollout, hardware=hardware)
    run_to_completion(topology, timeout=540)
    run = RunDir(tmp_path / "run")
    records = [json.loads(line) for line in run.rollout.read_text().splitlines()]
    assert len(records) == 2 * 2
    for record in records:
        for t in record["group"]["trajectories"]:
            check_trajectory(t)
            assert set(t["generators"]) == {"gen-b"}  # every token was decoded there
    (env,) = log_events(tmp_path / "run", "env-0", "env_host.summary")
    served = env["routing"]["generators"]
    turns = sum(t["turns"] for r in records for t in r["group"]["trajectories"])
    assert served["gen-c"]["prefills"] >= turns  # each turn's prefill half (plus any of trajectories cut short)
    assert sum(served["gen-c"]["calls"].values()) == 0  # it decoded nothing
    (decoder,) = log_events(tmp_path / "run", "gen-b", "generator.summary")
    assert decoder["kv_reused_tokens"] > 0  # prompts' whole blocks came through the store, not recomputed
    assert list(store.iterdir()) == []  # every handed-on prompt was read, then removed
