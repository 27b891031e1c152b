"""A dataset task trained by real node processes on loopback, with its held-out evaluation
(`run.rollout.eval`): the shipped arithmetic file, scored by `math_verify` in the reward gateway's
workers, and a round of greedy and sampled held-out groups before the first step, after each step, and
after the last, in the metrics and in TensorBoard's events."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.rundir import RunDir
from tests.integration.cluster import Cluster, make_cluster
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.integration

STEPS = 2
PROBLEMS = 3
SHIPPED = ROOT / "examples" / "datasets" / "arithmetic.jsonl"


def run_yaml(model: Path) -> str:
    return f"""  model: {{path: {model}}}
  generator: {{backend: hf}}
  reward_pool: {{min_workers: 0, max_workers: 1, idle_timeout_s: 30}}
  trainer: {{lr: 0.001, micro_batch_size: 16, checkpoint_every: 0, threads: 1, weights: {{transport: tcp}}}}
  rollout:
    mode: train
    tasks:
      - {{name: arithmetic, env: dataset, env_kwargs: {{path: {SHIPPED}, template: "{{question}}"}},
          reward: math_verify, system_prompt: "", max_tokens_per_turn: 4}}
    group_size: 2
    redundancy: 0
    batch_groups: 2
    steps: {STEPS}
    groups_per_env_host: 2
    eval:
      every: 1
      problems: {PROBLEMS}
      k: 2
      tasks: [{{of: arithmetic, env_kwargs: {{split: heldout}}}}]
"""


@pytest.mark.timeout(300)
def test_dataset_env_run_evaluates_held_out_pass_at_1_and_pass_at_k_each_step(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cluster = make_cluster(clusters, tmp_path, run_yaml(tiny_model))
    cluster.start()
    cluster.wait_healthy(timeout=120)
    done = cluster.wait_status("trainer", lambda s: s["done"], 240, "the trainer to finish its steps")
    assert done["rollout"]["version"] == STEPS
    evals = [line for line in cluster.metrics() if line.get("eval")]
    assert [line["step"] for line in evals] == list(range(STEPS + 1)), evals  # before the first, each, the last
    for line in evals:
        figures = line["tasks"]["arithmetic-heldout"]
        assert (figures["problems"], figures["lost"]) == (PROBLEMS, 0), line
        assert all(0.0 <= figures[key] <= 1.0 for key in ("pass@1", "pass@2", "mean@2")), line
        assert figures["pass@2"] >= figures["mean@2"] - 1e-9, line  # at least one of two tries, or none
        assert line["version"] == line["step"] and line["versions"][0] >= line["step"], line
    # Eval groups are never trained on: the dispenser granted only training groups.
    steps = [line for line in cluster.metrics() if "step" in line and not line.get("eval")]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    assert done["rollout"]["dispenser"]["completed"] >= STEPS * 2

    def tagged() -> list[int] | None:
        events = EventAccumulator(str(RunDir(cluster.run_dir).tensorboard))
        events.Reload()
        tag = "eval/tasks/arithmetic-heldout/pass@1"
        if tag not in events.Tags()["scalars"]:
            return None
        seen = [event.step for event in events.Scalars(tag)]
        return seen if len(seen) > STEPS else None

    assert wait_for(tagged, 15, "the eval lines in TensorBoard's events") == list(range(STEPS + 1))
