"""Where a step's time went: the parts read from a metrics line, and the progress line's words for them."""

from __future__ import annotations

import pytest

from rollart import step_times
from rollart.launch.terminal import training_line

LINE = {
    "time_wait_s": 2.0,
    "time_recompute_s": 0.0,
    "time_forward_s": 1.25,
    "time_backward_s": 3.0,
    "time_optimizer_s": 0.5,
    "stall_s": 0.01,
    "time_push_s": 0.04,
}


def test_the_parts_in_order_and_what_the_interval_leaves_over() -> None:
    parts = step_times.parts(LINE, interval=8.0)
    assert list(parts) == ["wait", "recompute", "forward", "backward", "optimizer", "export", "other"]
    assert parts["other"] == pytest.approx(8.0 - 6.76)
    assert step_times.parts(LINE, interval=5.0)["other"] == 0.0  # a clock that disagrees is not negative time
    assert step_times.parts({}) == dict.fromkeys(step_times.PARTS, 0.0)  # a line from before these were recorded


def test_the_progress_line_names_the_parts_that_took_time_and_the_push() -> None:
    assert step_times.describe(LINE) == "wait 2.0 forward 1.2 backward 3.0 optimizer 0.5 s | push 0.04"
    assert step_times.describe({}) == "no time recorded"
    last = LINE | {
        "tasks": {"lake": {"reward_ma": 0.5, "success_ma": 0.25}},
        "generator_busy": {"gen-0": 0.5},
        "traj_per_s": 10.0,
    }
    line = training_line({"batches": 3, "steps": 80}, last)
    assert line.startswith("step 3/80 | lake reward 0.50 success 0.25")
    assert line.endswith("busy gen-0 50% | step: wait 2.0 forward 1.2 backward 3.0 optimizer 0.5 s | push 0.04")
    assert "mismatch" not in line  # a step without tokens of the trainer's own version says nothing of it
    assert "| stale 0.00 | mismatch KL 3.2e-04 | 10.0 traj/s |" in training_line({}, last | {"mismatch_kl": 3.2e-4})
