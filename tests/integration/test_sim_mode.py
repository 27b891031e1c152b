"""Simulation mode with real node processes: the same trainer, dispenser, env-hosts, LLMProxy
routing and reward gateway, with simulated engines and environments timed by their models."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.sim.config import SimSpec
from rollart.sim.hardware import CostModel, EngineShape
from tests.integration.test_rollout import HARDWARE, NODES, batches, check_trajectory, run_to_completion
from tests.support import write_topology

pytestmark = pytest.mark.integration

SPEEDUP = 20.0
MATH_TOKENS = 600


def sim_yaml(model: Path) -> str:
    return f"""  model: {{path: {model}}}
  generator: {{backend: sim, max_batch_size: 128}}
  sim:
    speedup: {SPEEDUP}
    model: qwen3-8b
    engines: {{compute: {{gpu: H800, gpus: 1}}, bandwidth: {{gpu: H20, gpus: 1}}}}
  rollout:
    tasks:
      - name: lake
        env: sim
        env_kwargs: {{turns: 3, obs_tokens: 300, reset_s: 1.0, step_s: 0.5, sigma: 0.0}}
        profile: prefill-heavy
        max_tokens_per_turn: 4
        max_total_tokens: 4096
      - name: math
        env: sim
        env_kwargs: {{turns: 1, obs_tokens: 40, profile: decode-heavy}}
        profile: decode-heavy
        max_tokens_per_turn: {MATH_TOKENS}
        max_total_tokens: 4096
    group_size: 4
    redundancy: 0
    batch_groups: 4
    steps: 4
    groups_per_env_host: 4
"""


@pytest.mark.timeout(300)
def test_a_simulated_rollout_runs_on_the_real_scheduling_code(tmp_path: Path) -> None:
    from rollart.engines.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    topology, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=sim_yaml(model))
    run_to_completion(topology)
    records = batches(tmp_path / "run")
    assert len(records) == 4 * 4
    trajectories = [t for r in records for t in r["group"]["trajectories"]]
    assert len({t["trajectory_id"] for t in trajectories}) == len(trajectories) == 4 * 4 * 4
    spec = SimSpec(model="qwen3-8b")
    h20 = CostModel.build(EngineShape(gpu="H20", gpus=1), spec.model)
    decode_alone = sum(h20.decode_step_s(1, 41 + i) for i in range(MATH_TOKENS))  # the roofline, one request
    for t in trajectories:
        check_trajectory(t)
        expected = "gen-compute" if t["task"] == "lake" else "gen-bandwidth"
        assert set(t["generators"]) == {expected}  # routed by profile, as in a real run
        if t["task"] == "math":
            assert sum(t["response_mask"]) == MATH_TOKENS
            # simulated generation took at least what the hardware model says one request takes
            assert t["gen_wait_s"] * SPEEDUP >= 0.9 * decode_alone, (t["gen_wait_s"], decode_alone)
        else:
            assert t["turns"] == 3
            assert t["env_wait_s"] * SPEEDUP >= 0.9 * (1.0 + 3 * 0.5)  # reset + three steps, simulated
