"""Rollout with real node processes on loopback: groups, masks, routing, failures, alpha."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollart.rundir import RunDir
from tests.support import ROOT, healthy, http, node_env, wait_for, write_topology

pytestmark = pytest.mark.integration

NODES = {
    "trainer": "trainer",
    "gen-compute": "generator",
    "gen-bandwidth": "generator",
    "env-0": "env-host",
    "env-1": "env-host",
    "reward": "reward-gateway",
}
HARDWARE = {"gen-compute": "compute", "gen-bandwidth": "bandwidth"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart.tiny.model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def rollout_yaml(
    model: Path,
    *,
    steps: int,
    alpha: int = 1,
    redundancy: int = 1,
    lake_env: str = "frozen-lake",
    extra: str = "",
    routing: str = "finish-time",
) -> str:
    return f"""  model: {{path: {model}}}
  generator: {{backend: hf}}
  reward_pool: {{min_workers: 0, max_workers: 2, idle_timeout_s: 2}}
  rollout:
    routing: {routing}
    tasks:
      - {{name: lake, env: {lake_env}, profile: prefill-heavy, max_turns: 3, max_tokens_per_turn: 12{extra}}}
      - {{name: reverse, env: copy-reverse, reward: exact-answer, profile: decode-heavy, max_tokens_per_turn: 40}}
    group_size: 2
    redundancy: {redundancy}
    batch_groups: 2
    alpha: {alpha}
    steps: {steps}
    groups_per_env_host: 2
    generate_timeout_s: 30
"""


def run_to_completion(topology: Path, timeout: float = 240) -> str:
    env = {k: v for k, v in node_env().items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
    result = subprocess.run(  # noqa: PLW1510 - the exit code is what is checked
        [sys.executable, "-m", "rollart.cli", "run", str(topology)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def launch_and_wait_for_a_batch(topology: Path, ports: dict[str, tuple[int, int]]) -> subprocess.Popen[str]:
    """`rollart run` in the background, returned once the trainer has taken its first batch."""
    env = {k: v for k, v in node_env().items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.cli", "run", str(topology)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trainer_admin = ports["trainer"][1]
    try:
        wait_for(lambda: healthy(trainer_admin), 60, "trainer healthy")
        wait_for(lambda: http("GET", trainer_admin, "/status")[1]["rollout"]["batches"] >= 1, 120, "a first batch")
    except BaseException:
        proc.kill()
        raise
    return proc


def batches(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in RunDir(run_dir).rollout.read_text().splitlines()]


def log_events(run_dir: Path, node: str, event: str) -> list[dict[str, Any]]:
    lines = RunDir(run_dir).node_log(node).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if r.get("event") == event]


def check_trajectory(t: dict[str, Any]) -> None:
    n = len(t["response_ids"])
    assert n == len(t["response_mask"]) == len(t["logprobs"]) == len(t["versions"]) and n > 0
    for mask, logprob, version in zip(t["response_mask"], t["logprobs"], t["versions"], strict=True):
        if mask:
            assert logprob <= 0.0 and version >= 0
        else:
            assert logprob == 0.0 and version == -1
    assert sum(t["response_mask"]) >= 1 and t["turns"] >= 1


@pytest.mark.timeout(300)
def test_rollout_only_run_collects_complete_groups_and_routes_by_profile(tmp_path: Path, tiny_model: Path) -> None:
    # The paper's class routing, whose every turn goes to its task's class (finish-time routing may
    # overrule the class: tests/unit/test_proxy_routing.py, tests/integration/test_sim_mode.py).
    extra_run = rollout_yaml(tiny_model, steps=3, routing="class")
    topology, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=extra_run)
    run_to_completion(topology)
    run_dir = tmp_path / "run"
    records = batches(run_dir)
    assert len(records) == 3 * 2  # steps x groups per batch
    group_ids = [r["group"]["group_id"] for r in records]
    assert len(set(group_ids)) == len(group_ids)
    trajectory_ids = [t["trajectory_id"] for r in records for t in r["group"]["trajectories"]]
    assert len(set(trajectory_ids)) == len(trajectory_ids) == 3 * 2 * 2
    for record in records:
        assert len(record["group"]["trajectories"]) == 2
        for t in record["group"]["trajectories"]:
            check_trajectory(t)
            assert t["started_at_version"] >= record["version"] - 1  # alpha = 1
            expected = "gen-compute" if t["task"] == "lake" else "gen-bandwidth"
            assert set(t["generators"]) == {expected}, t["generators"]


@pytest.mark.timeout(300)
def test_context_last_gives_every_turn_a_fresh_prompt(tmp_path: Path, tiny_model: Path) -> None:
    extra_run = rollout_yaml(tiny_model, steps=2, extra=", context: last")
    topology, _ = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=extra_run)
    run_to_completion(topology)
    trajectories = [t for r in batches(tmp_path / "run") for t in r["group"]["trajectories"]]
    lake = [t for t in trajectories if t["task"] == "lake"]
    assert lake and any(t["turns"] > 1 for t in lake)
    for t in trajectories:
        check_trajectory(t)
        if t["task"] != "lake":
            assert t["segments"] == []  # the other task keeps its whole conversation
            continue
        assert len(t["segments"]) == t["turns"] - 1  # one per later turn; none after the last reply
        ids, mask, first = t["response_ids"], t["response_mask"], t["prompt_ids"]
        for cut in t["segments"]:
            # the same chat header and system prompt as the first prompt, none of the earlier turns
            assert ids[cut : cut + 16] == first[:16]
            prompt_len = mask[cut:].index(1)
            assert mask[cut : cut + prompt_len] == [0] * prompt_len
            # one observation (the feedback line instead of the first one's intro), not the history
            assert prompt_len < len(first) + 50


@pytest.mark.timeout(300)
def test_killing_a_generator_mid_run_loses_and_duplicates_nothing(tmp_path: Path, tiny_model: Path) -> None:
    topology, ports = write_topology(tmp_path, NODES, hardware=HARDWARE, extra_run=rollout_yaml(tiny_model, steps=6))
    proc = launch_and_wait_for_a_batch(topology, ports)
    try:
        pid = http("GET", ports["gen-compute"][1], "/status")[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "node gen-compute was killed by SIGKILL" in out
    records = batches(tmp_path / "run")
    assert len(records) == 6 * 2
    trajectory_ids = [t["trajectory_id"] for r in records for t in r["group"]["trajectories"]]
    assert len(set(trajectory_ids)) == len(trajectory_ids)
    for record in records:
        assert len(record["group"]["trajectories"]) == 2
        for t in record["group"]["trajectories"]:
            check_trajectory(t)


@pytest.mark.timeout(300)
def test_a_flaky_environment_fails_trajectories_not_the_run(tmp_path: Path, tiny_model: Path) -> None:
    flaky = ", env_kwargs: {inner: frozen-lake, reset_failure: 0.2, step_failure: 0.2}"
    topology, _ = write_topology(
        tmp_path,
        NODES,
        hardware=HARDWARE,
        extra_run=rollout_yaml(tiny_model, steps=4, lake_env="flaky", extra=flaky),
    )
    out = run_to_completion(topology)
    assert "finished the run" in out
    records = batches(tmp_path / "run")
    assert len(records) == 4 * 2
    finals = log_events(tmp_path / "run", "env-0", "env_host.summary") + log_events(
        tmp_path / "run", "env-1", "env_host.summary"
    )
    assert sum(f.get("env_failures", 0) for f in finals) > 0, finals


@pytest.mark.timeout(300)
# alpha 0 and 2 behind the slow marker: minutes of the default test run on 2 cores; CI runs them (bin/test --all)
@pytest.mark.parametrize("alpha", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow)])
def test_no_delivered_group_breaks_the_alpha_bound(tmp_path: Path, tiny_model: Path, alpha: int) -> None:
    topology, _ = write_topology(
        tmp_path, NODES, hardware=HARDWARE, extra_run=rollout_yaml(tiny_model, steps=4, alpha=alpha)
    )
    run_to_completion(topology)
    records = batches(tmp_path / "run")
    assert len(records) == 4 * 2
    for record in records:
        for t in record["group"]["trajectories"]:
            assert t["started_at_version"] >= record["version"] - alpha


@pytest.mark.timeout(300)
def test_redundant_trajectories_are_aborted_and_their_envs_closed(tmp_path: Path, tiny_model: Path) -> None:
    # Uneven environment latency (half the steps take 0.3 s), so the members of a group finish apart.
    slow = ", env_kwargs: {inner: frozen-lake, reset_failure: 0, step_failure: 0, hang_s: 0.3, hang_prob: 0.5}"
    topology, _ = write_topology(
        tmp_path,
        NODES,
        hardware=HARDWARE,
        extra_run=rollout_yaml(tiny_model, steps=3, redundancy=3, lake_env="flaky", extra=slow),
    )
    run_to_completion(topology)
    run_dir = tmp_path / "run"
    assert len(batches(run_dir)) == 3 * 2
    envs = [e for node in ("env-0", "env-1") for e in log_events(run_dir, node, "env_host.summary")]
    assert sum(e.get("cancelled_extras", 0) for e in envs) > 0, envs
    for summary in envs:
        assert summary.get("envs_opened", 0) == summary.get("envs_closed", 0) > 0
    # Extras cancelled while generating: the env-host's proxy told the generators, which aborted them.
    cancelled_calls = sum(e["routing"]["cancelled"] for e in envs)
    generators = [
        e for node in ("gen-compute", "gen-bandwidth") for e in log_events(run_dir, node, "generator.summary")
    ]
    assert cancelled_calls > 0 and sum(g["aborted"] for g in generators) > 0, (cancelled_calls, generators)
    (trainer,) = log_events(run_dir, "trainer", "trainer.summary")
    # every granted group came back (accepted or re-issued) or is still in flight: no capacity leaks
    ended = trainer["completed"] + trainer["reissued"] + trainer["abandoned"]
    assert trainer["granted"] == ended + trainer["in_flight"], trainer
    assert trainer["in_flight"] <= trainer["limit"]


@pytest.mark.timeout(300)
def test_routing_fails_over_when_a_hardware_class_is_down(tmp_path: Path, tiny_model: Path) -> None:
    topology, ports = write_topology(
        tmp_path, NODES, hardware=HARDWARE, restart="never", extra_run=rollout_yaml(tiny_model, steps=5)
    )
    proc = launch_and_wait_for_a_batch(topology, ports)
    try:
        os.kill(http("GET", ports["gen-bandwidth"][1], "/status")[1]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert "restart policy never: leaving it down" in out
    records = batches(tmp_path / "run")
    assert len(records) == 5 * 2
    late = [t for r in records[-4:] for t in r["group"]["trajectories"]]
    assert {t["task"] for t in late} <= {"lake", "reverse"}
    for t in late:  # after the bandwidth generator died, every task ran on the compute one
        assert t["generators"][-1] == "gen-compute", t["generators"]
