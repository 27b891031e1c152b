"""Simulation mode, with real node processes and in-process on a virtual clock: the same trainer,
dispenser, env-hosts, LLMProxy routing and reward gateway (the daemons of `rollart.nodes`, no copy),
with simulated engines, environments and reward timed by their models."""

from __future__ import annotations

import collections
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollart.errors import ConfigError
from rollart.launch.inprocess import InProcessRun, check_inprocess, run_inprocess
from rollart.nodes.generator import SLOW_ENV
from rollart.sim.config import SimSpec
from rollart.sim.hardware import MODELS, CostModel, EngineShape, transfer_s
from rollart.topology import load_topology
from tests.integration.test_rollout import HARDWARE, NODES, batches, check_trajectory, log_events, run_to_completion
from tests.support import ROOT, node_env, write_topology

pytestmark = pytest.mark.integration

SPEEDUP = 20.0
MATH_TOKENS = 600


def sim_yaml(model: Path, speedup: float = SPEEDUP, sim_extra: str = "", routing: str = "class") -> str:
    """`routing: class` unless told: `check_simulated` checks that each task went to its class, as the paper routes."""
    return f"""  model: {{path: {model}}}
  generator: {{backend: sim, max_num_seqs: 128}}
  sim:
    speedup: {speedup}
    model: qwen3-8b{sim_extra}
    engines: {{compute: {{gpu: H800, gpus: 1}}, bandwidth: {{gpu: H20, gpus: 1}}}}
  rollout:
    routing: {routing}
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
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    topology, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=sim_yaml(model))
    run_to_completion(topology)
    records = batches(tmp_path / "run")
    assert len(records) == 4 * 4
    check_simulated([t for r in records for t in r["group"]["trajectories"]], SPEEDUP)


def check_simulated(trajectories: list[dict[str, Any]], speedup: float) -> None:
    """Four batches of four groups of four; routed by profile; timed at least as the models say."""
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
            assert t["gen_wait_s"] * speedup >= 0.9 * decode_alone, (t["gen_wait_s"], decode_alone)
        else:
            assert t["turns"] == 3
            assert t["env_wait_s"] * speedup >= 0.9 * (1.0 + 3 * 0.5)  # reset + three steps, simulated


INPROCESS = """
    reward: {placement: instant}
    trainer: {gpu: H800, gpus: 8, link_gbps: 50.0, push: PUSH}"""


def inprocess(tmp_path: Path, push: str = "async", routing: str = "class") -> InProcessRun:
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    extra = sim_yaml(model, speedup=1.0, sim_extra=INPROCESS.replace("PUSH", push), routing=routing)
    path, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=extra)
    return run_inprocess(load_topology(path), log=tmp_path / "nodes.log")


@pytest.mark.timeout(300)
def test_the_same_nodes_run_in_process_on_a_virtual_clock(tmp_path: Path) -> None:
    from rollart.nodes.trainer_rollout_only import as_record

    done = inprocess(tmp_path)
    assert {type(node).__name__ for node in done.nodes.values()} == {
        "TrainerNode",
        "GeneratorNode",
        "EnvHostNode",
        "RewardGatewayNode",
    }
    assert [batch.version for batch in done.batches] == [0, 1, 2, 3]
    assert all(len(batch.groups) == 4 for batch in done.batches)
    check_simulated([as_record(t) for b in done.batches for g in b.groups for t in g.trajectories], 1.0)
    assert done.sim_s > 10 * done.wall_s or done.sim_s > 60  # simulated time is not paid in real time
    assert done.generator_busy.keys() == {"gen-compute", "gen-bandwidth"}
    assert 0 < done.generator_busy["gen-bandwidth"] <= 1


@pytest.mark.timeout(300)
def test_disaggregated_routing_prefills_on_compute_and_decodes_on_bandwidth(tmp_path: Path) -> None:
    """`routing: disaggregated`: every turn is prefilled on the H800 and decoded on the H20, which receives
    the prompt's KV cache instead of prefilling it."""
    from rollart.generation.sim import SimEngine
    from rollart.nodes import GeneratorNode
    from rollart.nodes.trainer_rollout_only import as_record

    done = inprocess(tmp_path, routing="disaggregated")
    trajectories = [as_record(t) for b in done.batches for g in b.groups for t in g.trajectories]
    assert len(trajectories) == 4 * 4 * 4
    for t in trajectories:
        check_trajectory(t)
        assert set(t["generators"]) == {"gen-bandwidth"}  # where each turn was decoded
    engines = {}
    for name in ("gen-compute", "gen-bandwidth"):
        node = done.nodes[name]
        assert isinstance(node, GeneratorNode) and node.engine is not None
        engines[name] = engine = node.engine.engines[0]
        assert isinstance(engine, SimEngine)
    compute, bandwidth = engines["gen-compute"], engines["gen-bandwidth"]
    assert compute.generated_tokens == 0 and compute.prefilled_tokens > 0
    assert bandwidth.prefilled_tokens == 0 and 0 < bandwidth.kv_received_tokens <= compute.prefilled_tokens
    assert bandwidth.generated_tokens >= sum(sum(t["response_mask"]) for t in trajectories)


@pytest.mark.timeout(300)
def test_a_synchronous_weight_push_stops_generation_and_the_trainer(tmp_path: Path) -> None:
    sync, asynchronous = inprocess(tmp_path / "sync", "sync"), inprocess(tmp_path / "async", "async")
    # A copy to each of the two engines: 5.2 s, longer than the math env's reset that could hide it.
    push_s = transfer_s(MODELS["qwen3-8b"], gbps=50.0) * 2
    gap = statistics.fmean(sync.step_s) - statistics.fmean(asynchronous.step_s)
    assert gap > 0.5 * push_s, (sync.step_s, asynchronous.step_s, push_s)


def test_what_keeps_a_topology_from_running_in_process_is_named(tmp_path: Path) -> None:
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    path, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=sim_yaml(model))
    with pytest.raises(ConfigError) as caught:
        check_inprocess(load_topology(path))
    assert "run.sim.speedup: must be 1" in str(caught.value)
    assert "run.sim.reward: needed in-process" in str(caught.value)


def test_rollart_simulate_prints_what_happened(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollart.cli import main
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    extra = sim_yaml(model, speedup=1.0, sim_extra=INPROCESS.replace("PUSH", "async"))
    path, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=extra)
    assert main(["simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "batches 4, trajectories 64" in out and "generators busy: gen-compute" in out
    (tmp_path / "bad").mkdir()
    bad, _ = write_topology(tmp_path / "bad", NODES, hardware=HARDWARE, extra_run=sim_yaml(model))  # speedup 20
    assert main(["simulate", str(bad)]) == 2
    assert "cannot run in-process" in capsys.readouterr().err


def test_the_shipped_simulation_topology_is_valid() -> None:
    from rollart.launch.inprocess import check_inprocess

    check_inprocess(load_topology(Path(__file__).resolve().parents[2] / "configs" / "sim-paper.yaml"))


@pytest.mark.timeout(300)
# Seeds 1 and 2 repeat the check of seed 0 on other draws: slow (CI runs them; bin/test --all), 26 s of the default run.
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_a_slowed_generator_is_sent_less_work_by_the_finish_time_router(tmp_path: Path, seed: int) -> None:
    """Real node processes; two generators of one class, one slowed by `ROLLART_SLOW_GENERATOR` (each of its
    calls waits 0.2 s first, about ten times what a turn takes here): the env-hosts' routers send it few turns.
    Three rollout seeds (issue 23 asks for three)."""
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    nodes = {"trainer": "trainer", "gen-fast": "generator", "gen-slow": "generator", "env-0": "env-host"}
    nodes["reward"] = "reward-gateway"
    hardware = {"gen-fast": "compute", "gen-slow": "compute"}
    extra = sim_yaml(model, routing="finish-time").replace(
        "    group_size: 4\n", f"    group_size: 4\n    seed: {seed}\n"
    )
    assert f"seed: {seed}" in extra
    topology, _ = write_topology(tmp_path, nodes, hardware=hardware, extra_run=extra)
    env = {k: v for k, v in node_env().items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
    result = subprocess.run(  # noqa: PLW1510 - the exit code is what is checked
        [sys.executable, "-m", "rollart.cli", "run", str(topology)],
        cwd=ROOT,
        env={**env, SLOW_ENV: "gen-slow:0.2"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    turns = collections.Counter(
        g for r in batches(tmp_path / "run") for t in r["group"]["trajectories"] for g in t["generators"]
    )
    assert turns["gen-fast"] + turns["gen-slow"] == sum(turns.values()) > 0
    assert turns["gen-slow"] < 0.2 * sum(turns.values()), turns
    assert log_events(tmp_path / "run", "gen-slow", "generator.slowed")  # it said so, loudly
