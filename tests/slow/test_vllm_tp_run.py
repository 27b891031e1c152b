"""A run of `configs/gpu-node.yaml`'s shape on CPU, every node a real process: an FSDP2 trainer (2 ranks here, 4
GPUs there), two vLLM generators (one on fewer than 4 cores: `GENERATORS`) each running one engine of two
tensor-parallel workers, an env-host and a reward gateway, on the lake and repeat tasks. It trains 10 steps, and
every version a generator loads reaches both of its workers (pushed over TCP, and by a group broadcast:
`transport: nccl`, gloo here): each load is logged once by the engine, naming the two workers that swapped it in,
and no engine ever held two versions at once. A generator whose engine dies ends and is restarted; nothing else may
fail.

Needs vLLM: `bin/setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_tp_run.py` (CI does). The
engines' workers share this machine's cores with the trainer's ranks, so the run is slow (minutes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from rollart.rundir import RunDir
from tests.integration.test_rollout import run_to_completion
from tests.support import ROOT, write_topology

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")
pytestmark = [pytest.mark.slow, pytest.mark.integration]

CORES = len(os.sched_getaffinity(0))
GENERATORS = ("gen-0", "gen-1") if CORES >= 4 else ("gen-0",)
"""gpu-node.yaml's two generators where there are 4 cores; one below that. On 2 cores two engines of two CPU workers
each passed once (161 s) and twice hung in their first step until vLLM's 300 s timeout, every worker spinning (load
average 13): vLLM's CPU all-reduce waits by spinning, and four workers then spin on two cores."""

STEPS = 10


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("transport", ["tcp", "nccl"])  # nccl: a gloo group here, into the engines' shared memory
def test_tp_push_a_gpu_node_shaped_run_trains_10_steps_with_every_version_on_every_worker(
    tmp_path: Path, transport: str
) -> None:
    from rollart.tiny.model import ensure_tiny_model

    shape = yaml.safe_load((ROOT / "configs/gpu-node.yaml").read_text())
    gen = shape["run"]["generator"]
    assert (gen["backend"], gen["tensor_parallel_size"], shape["run"]["trainer"]["backend"]) == ("vllm", 2, "fsdp2")
    model = ensure_tiny_model(tmp_path / "tiny", seed=0)
    run = f"""  model: {{path: {model}}}
  generator: {{backend: vllm, engines: 1, tensor_parallel_size: 2, max_num_seqs: 16}}
  reward_pool: {{min_workers: 1, max_workers: 2}}
  trainer: {{backend: fsdp2, ranks: 2, lr: 0.001, checkpoint_every: 0, weights: {{transport: {transport}}}}}
  rollout:
    mode: train
    schedule: async
    steps: {STEPS}
    batch_groups: 2
    group_size: 4
    redundancy: 1
    alpha: 1
    groups_per_env_host: 4
    tasks:
      - {{name: lake, env: frozen-lake, context: last, system_prompt: "", max_tokens_per_turn: 1, weight: 5,
          env_kwargs: {{layout: SFFF/FHFH/FFFH/HFFG, actions: letters, compact: true, max_turns: 6}}}}
      - {{name: repeat, env: copy-reverse, max_tokens_per_turn: 12, weight: 2,
          env_kwargs: {{mode: repeat, min_len: 12, max_len: 12, alphabet: UDLR, boxed: false}}}}
"""
    nodes = {"trainer": "trainer", **dict.fromkeys(GENERATORS, "generator"), "env-0": "env-host"}
    nodes["reward"] = "reward-gateway"
    topology, _ = write_topology(tmp_path, nodes, extra_run=run, hardware=dict.fromkeys(GENERATORS, "compute"))
    run_to_completion(topology, timeout=1400)

    run_dir = RunDir(tmp_path / "run")
    steps = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [s["step"] for s in steps if "step" in s][-1] == STEPS
    for name in GENERATORS:
        events = [json.loads(line) for line in run_dir.node_log(name).read_text().splitlines() if line.startswith("{")]
        loads = [e for e in events if e.get("event") == "vllm weights loaded"]
        assert loads, f"{name} loaded no version"
        assert {e["workers"] for e in loads} == {2}, name  # every load: both workers swapped it in
        assert [e["version"] for e in loads] == sorted(e["version"] for e in loads), name  # in order
        assert loads[-1]["version"] >= STEPS - 1, name  # it kept up to (at most one behind) the last step
        assert not [e for e in events if e.get("event") == "vllm weights mixed"], name
        if transport == "nccl":
            assert [e for e in events if e.get("event") == "weights.group_joined"], name
        # An engine that dies (two engines of two workers on 2 cores once hung in their first step until vLLM's
        # 300 s timeout) ends its node, which is restarted: the run goes on, and says so.
        for failed in (e for e in events if e.get("event") == "node.failed"):
            assert "EngineClosed" in failed["error"], failed
