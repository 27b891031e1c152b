"""The BPE test model (Qwen3's architecture, template, special tokens and two EOS ids, saved in bf16) trained by
real node processes on loopback: the generators run it in its own dtype, multi-turn episodes go through Qwen3's
template with thinking off (`context: template`: each turn a sequence of its own) and on (`context: full`), and
the trainer takes its steps. Slow (a 29M-parameter model on CPU); `bin/test --all` and CI run it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.cluster import GENERATORS, Cluster, make_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2


def run_yaml(model: Path) -> str:
    return f"""  model: {{path: {model}, build_tiny_if_missing: false}}
  generator: {{backend: hf, dtype: auto}}
  reward_pool: {{min_workers: 0, max_workers: 1}}
  trainer: {{lr: 0.0001, micro_batch_size: 8, checkpoint_every: 0, threads: 1, weights: {{transport: tcp}}}}
  rollout:
    mode: train
    tasks:
      - {{name: lake, env: frozen-lake, max_turns: 3, max_tokens_per_turn: 8, context: template, thinking: false}}
      - {{name: copy, env: copy-reverse, env_kwargs: {{mode: copy, min_len: 3, max_len: 4}}, max_tokens_per_turn: 8,
          context: full, thinking: true}}
    group_size: 2
    redundancy: 0
    batch_groups: 2
    steps: {STEPS}
    groups_per_env_host: 2
    generate_timeout_s: 120
"""


@pytest.mark.timeout(420)
def test_thinking_on_and_off_with_the_bpe_model_in_a_real_run(
    tmp_path: Path, qwen3_bpe_dir: Path, clusters: list[Cluster]
) -> None:
    cluster = make_cluster(clusters, tmp_path, run_yaml(qwen3_bpe_dir))
    cluster.start()
    cluster.wait_healthy(timeout=180)
    done = cluster.wait_status("trainer", lambda s: s["done"], 360, "the trainer to finish its steps")
    assert done["rollout"]["version"] == STEPS
    for name in GENERATORS:
        # the last push is asynchronous: the trainer is done before every generator has applied it
        engine = cluster.wait_status(
            name, lambda s: s["engine"]["weights"]["version"] == STEPS, 60, f"{name} to apply the last weights"
        )["engine"]
        assert engine["dtype"] == "bfloat16" and engine["engines"] == 1, engine  # the checkpoint's own
    steps = [line for line in cluster.metrics() if "step" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"]) for line in steps), steps
