"""Agent episodes in a real run: an env-host starts an agent program (a script with the `openai` package) per
episode of an `env: agent` task, in the env workers' sandbox, and serves its calls through its OpenAI-compatible
endpoint; the trainer receives each episode's tokens exactly as generated. Every node a real process.

Slow (a Python with `openai` started per episode, on 2 cores: minutes); `bin/test --all` and CI run it.
`-k agent_episode` selects it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.rundir import RunDir
from tests.integration.test_rollout import check_trajectory, log_events, run_to_completion
from tests.support import write_topology

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CWD = "tests/integration"  # relative to the env-host's working directory (the repository root here)
NODES = {"trainer": "trainer", "gen-0": "generator", "env-0": "env-host", "reward": "reward-gateway"}


@pytest.mark.timeout(300)
def test_agent_episode_programs_play_their_episodes_and_a_crash_fails_only_its_own(tmp_path: Path) -> None:
    from rollart.tiny.model import ensure_tiny_model
    from tests.unit.test_chat_render import load

    model = ensure_tiny_model(tmp_path / "tiny", seed=0)
    run = f"""  model: {{path: {model}}}
  generator: {{backend: hf}}
  reward_pool: {{min_workers: 0, max_workers: 1, idle_timeout_s: 2}}
  rollout:
    tasks:
      - {{name: chat, env: agent, agent: {{command: ["{{python}}", "agent_programs.py", "flaky"], cwd: {CWD}}},
          max_turns: 4, max_tokens_per_turn: 6, max_total_tokens: 400}}
    group_size: 2
    redundancy: 1
    batch_groups: 2
    steps: 3
    groups_per_env_host: 2
    generate_timeout_s: 30
"""
    topology, _ = write_topology(tmp_path, NODES, extra_run=run)
    run_to_completion(topology)
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in RunDir(run_dir).rollout.read_text().splitlines()]
    assert len(records) == 3 * 2
    tokenizer = load(model)
    for record in records:
        for t in record["group"]["trajectories"]:
            check_trajectory(t)
            assert t["turns"] == 2 and t["finish"] == "done"
            assert t["seed"] % 3 != 0  # a crashed episode never reaches the trainer
            assert t["reward"] == (1.0 if t["seed"] % 2 == 0 else 0.0) and t["success"] == (t["seed"] % 2 == 0)
            # Two generated spans (the program's two calls), the template's turn between them.
            mask = t["response_mask"]
            spans = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
            assert spans == 2 and mask[0] == 1 and t["segments"] == []
            assert f"ab{t['seed'] % 7}" in tokenizer.decode(t["prompt_ids"])
            between = [tok for tok, m in zip(t["response_ids"], mask, strict=True) if not m]
            assert tokenizer.decode(between).rstrip().endswith("assistant")  # "b" as the next user turn, then ours
    failed = log_events(run_dir, "env-0", "group.trajectory_failed")
    crashed = [e for e in failed if "exited with 3" in e["error"]]
    assert crashed and all("the agent gives up" in e["error"] for e in crashed), failed[:3]
    launched = log_events(run_dir, "env-0", "agents.endpoint")
    assert launched and launched[0]["unix_socket"].endswith("endpoint.sock")
