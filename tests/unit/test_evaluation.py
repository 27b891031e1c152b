"""Held-out evaluation (`run.rollout.eval`): its settings, the trainer's rounds of eval groups, and where
their figures go (metrics line, trackers, run report). The groups run for real on a live cluster in
tests/integration/test_dataset_run.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rollart.protocol.messages import GroupDone, Trajectory
from rollart.report import build_report
from rollart.rollout.config import EvalSpec, EvalTaskSpec, RolloutSpec, TaskSpec
from rollart.rollout.dispenser import Dispenser
from rollart.rollout.evaluation import Evaluator
from rollart.rundir import JsonlLog, RunDir
from rollart.tracking import step_scalars

TASK = TaskSpec(name="arith", env="dataset", env_kwargs={"path": "a.jsonl", "split": "train"}, reward="math_verify")


def rollout(**eval_fields: Any) -> RolloutSpec:
    twin = EvalTaskSpec(of="arith", env_kwargs={"split": "heldout"})
    fields: dict[str, Any] = {"every": 5, "problems": 3, "k": 2, "tasks": [twin]} | eval_fields
    spec = EvalSpec(**fields)
    return RolloutSpec(mode="train", tasks=[TASK], eval=spec)


def trajectory(group_id: str, index: int, *, success: bool, reward: float = 0.0, version: int = 0) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group_id}.{index}",
        group_id=group_id,
        task="arith-heldout",
        seed=0,
        prompt_ids=[1],
        response_ids=[2, 3],
        response_mask=[1, 1],
        logprobs=[-0.5, -0.5],
        versions=[version, version + 1],
        reward=reward,
        env_reward=reward,
        turns=1,
        finish="done",
        started_at_version=version,
        started_at=0.0,
        finished_at=1.0,
        env_wait_s=0.0,
        gen_wait_s=0.0,
        success=success,
    )


def back(group_id: str, *solved: bool) -> GroupDone:
    """The group as an env-host hands it in: the first to finish first, not in index order."""
    return GroupDone(group_id, [trajectory(group_id, i, success=s) for i, s in reversed(list(enumerate(solved)))])


def test_eval_tasks_are_the_training_tasks_twins_with_their_env_kwargs_laid_over() -> None:
    spec = rollout()
    (twin,) = spec.eval_tasks()
    assert twin.name == "arith-heldout" and twin.reward == "math_verify"
    assert twin.env_kwargs == {"path": "a.jsonl", "split": "heldout"}
    assert [task.name for task in spec.all_tasks()] == ["arith", "arith-heldout"]
    assert spec.validate() == []


def test_eval_settings_that_cannot_work_are_refused_by_name() -> None:
    bad = RolloutSpec(
        tasks=[TASK],
        eval=EvalSpec(every=0, k=-1, tasks=[EvalTaskSpec(of="nope"), EvalTaskSpec(of="arith", name="arith")]),
    )
    problems = dict(bad.validate())
    assert problems["eval.every"] == "expected an integer >= 1; got 0"
    assert problems["eval.k"] == "expected an integer >= 0; got -1"
    assert "eval.first_seed" not in problems
    assert problems["eval.tasks[0].of"] == "no training task 'nope' (tasks: ['arith'])"
    assert problems["eval.tasks[1].name"] == "task name 'arith' is taken"
    assert "mode: train" in problems["eval"]  # rollout-only has no policy that changes
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"every": 5, "tasks": [], "problemz": 3}, EvalSpec)


def test_eval_a_round_gives_pass_at_1_greedy_and_pass_at_k_sampled() -> None:
    lines: list[dict[str, Any]] = []
    spec = rollout()
    evaluator = Evaluator(spec.eval, spec.eval_tasks(), write=lines.append)  # type: ignore[arg-type]
    assert [evaluator.due(step, 12) for step in (0, 3, 5, 10, 12)] == [True, False, True, True, True]
    evaluator.start(5, version=5)
    groups = [evaluator.grant("env-0") for _ in range(3)]
    assert evaluator.grant("env-0") is None
    assert all(g is not None and g.evaluation and g.greedy == 1 and g.group_size == 3 for g in groups)
    # the same problems every round, above the seeds training draws
    assert [g.seed for g in groups if g is not None] == [10**9, 10**9 + 1, 10**9 + 2]
    ids = [g.group_id for g in groups if g is not None]
    evaluator.done(back(ids[0], True, False, False))  # greedy solved it; no sampled try did
    evaluator.done(back(ids[1], False, False, True))  # one sampled try of two did
    assert not lines  # a group is still out
    evaluator.done(back(ids[2], False, False, False))
    (line,) = lines
    assert line["eval"] is True and (line["step"], line["version"]) == (5, 5)
    figures = line["tasks"]["arith-heldout"]
    assert figures == {"problems": 3, "lost": 0, "pass@1": 1 / 3, "pass@2": 1 / 3, "mean@2": 1 / 6}
    assert line["versions"] == [0, 1]
    assert not evaluator.rounds and asyncio.run(evaluator.wait_idle(0.1))


def test_eval_a_lost_group_is_counted_and_the_round_ends_without_it() -> None:
    lines: list[dict[str, Any]] = []
    now = [0.0]
    spec = rollout(problems=2, k=0)
    evaluator = Evaluator(spec.eval, spec.eval_tasks(), write=lines.append, clock=lambda: now[0])  # type: ignore[arg-type]
    evaluator.incarnation = 2
    evaluator.start(0, version=0)
    first, second = evaluator.grant("env-0"), evaluator.grant("env-1")
    assert first is not None and second is not None and first.group_id.startswith("i2.e0.")
    assert not asyncio.run(evaluator.wait_idle(0.05))
    evaluator.release_env_host("env-0", "the env-host restarted")
    evaluator.expire(timeout_s=10)  # not overdue yet
    now[0] = 11.0
    evaluator.done(GroupDone(second.group_id, [trajectory(second.group_id, 0, success=False, reward=1.0)]))
    (line,) = lines
    assert line["tasks"]["arith-heldout"] == {"problems": 1, "lost": 1, "pass@1": 1.0}  # solved by its reward
    evaluator.done(back(first.group_id, True))  # late, after it was counted lost: ignored
    assert len(lines) == 1


def test_eval_groups_do_not_wait_for_admission_room() -> None:
    async def scenario() -> None:
        spec = rollout()
        dispenser = Dispenser(msgspec.structs.replace(spec, batch_groups=1, alpha=0), buffered=lambda: 1)
        evaluator = Evaluator(spec.eval, spec.eval_tasks(), write=lambda line: None)  # type: ignore[arg-type]
        dispenser.other_work = lambda: bool(evaluator.queue)
        waiting = asyncio.ensure_future(dispenser.grant("env-0", 0, wait_s=10))  # no room: the buffer is full
        await asyncio.sleep(0.01)
        assert not waiting.done()
        evaluator.start(0, version=0)
        dispenser.wake_all()
        assert await asyncio.wait_for(waiting, 1) is None  # back at once, to take the eval group instead
        assert evaluator.grant("env-0") is not None

    asyncio.run(scenario())


def test_eval_lines_go_to_trackers_under_eval_and_into_the_run_report(tmp_path: Path) -> None:
    line = {"eval": True, "step": 20, "version": 20, "tasks": {"arith-heldout": {"problems": 3, "pass@1": 0.5}}}
    assert step_scalars(line) == (20, {"eval/version": 20.0, "eval/tasks/arith-heldout/problems": 3.0,
                                       "eval/tasks/arith-heldout/pass@1": 0.5})  # fmt: skip
    run = RunDir(tmp_path)
    step = {"step": 1, "elapsed_s": 1.0, "version": 1, "reward_mean": 0.1, "success_rate": 0.1}
    first = {"eval": True, "step": 0, "version": 0, "tasks": {"arith-heldout": {"problems": 3, "pass@1": 0.0}}}
    JsonlLog(run.metrics).write([first, step, line])
    out = build_report(tmp_path)
    report = (out / "report.md").read_text()
    assert "| step | version | arith-heldout pass@1 |" in report
    assert "| 0 | 0 | 0.000 |" in report and "| 20 | 20 | 0.500 |" in report
    assert (out / "eval.png").stat().st_size > 0
    assert "| steps | 1 (last step 1) |" in report  # eval lines are not steps
