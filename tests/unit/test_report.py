"""The run report: built from small hand-written run directories, its numbers checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.cli import main
from rollart.report import ReportError, build_report, moving_average
from rollart.rundir import RunDir, read_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("reward_success.png", "step_time.png", "utilization.png", "timeline.png")


def _write_jsonl(path: Path, records: list[dict[str, object]], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _step(step: int) -> dict[str, object]:
    """Step `step` of the synthetic run: copy reports every step, reverse only the even ones."""
    tasks: dict[str, object] = {"copy": {"reward_mean": float(step), "success_rate": step / 100, "count": 8}}
    if step % 2 == 0:
        tasks["reverse"] = {"reward_mean": -1.0, "success_rate": 0.5, "count": 4}
    return {
        "step": step,
        "elapsed_s": 6.0 * step,
        "version": step,
        "reward_mean": 0.0,
        "success_rate": 0.0,
        "tasks": tasks,
        "staleness_mean": 0.5,
        "staleness_max": step % 4,
        "traj_per_s": 1.0 + step % 2,
        "generator_busy": {"gen-0": 0.5},
        "loss": 0.1,
        # 5.25 s of the 6 s between two steps accounted for: 0.75 s "other"
        "time_wait_s": 1.0,
        "time_forward_s": 2.0,
        "time_backward_s": 1.5,
        "time_optimizer_s": 0.5,
        "stall_s": 0.25,
        "time_push_s": 0.1 * (step % 3),  # 0, 0.1, 0.2: median 0.1
    }


def _write_run(run_dir: Path, *, utilization: bool = True, timeline: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    files = RunDir(run_dir)
    header = {"run": {"name": "synthetic"}}
    baseline = {
        "baseline": True,
        "tasks": {"copy": {"success_rate": 0.05, "reward_mean": 0.25}, "reverse": {"success_rate": 0.0}},
    }
    # A killed run leaves half a line at the end.
    _write_jsonl(files.metrics, [header, baseline] + [_step(s) for s in range(1, 26)], '{"step": 26, "el')
    if utilization:
        samples = [("gen-0", 0.2), ("gen-1", 0.9), ("gen-0", 0.4), ("gen-1", 1.0), ("gen-0", 0.6)]
        _write_jsonl(
            files.utilization,
            [{"t": 10.0 * i, "generator": g, "busy": b} for i, (g, b) in enumerate(samples)],
        )
    if timeline:
        trajectories = []
        for i in range(250):  # more than the timeline shows, so it keeps the last 200
            start = 0.6 * i
            spans = [
                ["gen", start, start + 0.2],
                ["env", start + 0.3, start + 0.4],
                ["reward", start + 0.4, start + 0.5],
            ]
            trajectories.append(
                {
                    "trajectory_id": f"t{i}",
                    "task": "copy",
                    "step": i // 10 + 1,
                    "generators": ["gen-0"],
                    "started_at": start,
                    "finished_at": start + 0.5,
                    "spans": spans,
                }
            )
        _write_jsonl(files.timeline, trajectories)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    _write_run(run_dir)
    return build_report(run_dir)


def test_moving_average_is_the_mean_of_what_is_there_at_the_start() -> None:
    assert moving_average([2.0, 4.0]) == [2.0, 3.0]
    assert moving_average([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([]) == []


def test_the_report_has_every_plot_as_a_real_png(report_dir: Path) -> None:
    assert report_dir == RunDir(report_dir.parent).report
    for name in PLOTS:
        data = (report_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 10_000, f"{name} is only {len(data)} bytes"


def test_the_summary_has_the_numbers_of_the_run(report_dir: Path) -> None:
    text = (report_dir / "report.md").read_text()
    # 25 whole steps: the truncated 26th line is dropped; the last one at 25 * 6 s.
    assert "| steps | 25 (last step 25) |" in text
    assert "| elapsed | 150.0 s (2.5 min) |" in text
    assert "| mean traj/s | 1.52 |" in text  # 13 odd steps at 2.0, 12 even at 1.0: 38 / 25
    assert "| max staleness | 3 |" in text
    # copy: the last 20 steps are 6..25, success step/100 averages 0.155 and reward step 15.5.
    assert "| copy | 25 | 0.155 | 0.050 | 15.500 | 0.250 |" in text
    # reverse: 12 steps, fewer than the window, so the mean of all; its baseline has no reward.
    assert "| reverse | 12 | 0.500 | 0.000 | -1.000 | n/a |" in text
    # busy from utilization.jsonl, not metrics' generator_busy: (0.2+0.4+0.6)/3, (0.9+1.0)/2, their mean.
    assert "| gen-0 | 0.400 |" in text
    assert "| gen-1 | 0.950 |" in text
    assert "| **all** | 0.675 |" in text
    for name in PLOTS:
        assert f"]({name})" in text


def test_the_summary_says_where_a_step_went(report_dir: Path) -> None:
    text = (report_dir / "report.md").read_text()
    header = "| step | wait | recompute | forward | backward | optimizer | export | other | push | apply | traj gen |"
    assert header in text
    assert "| 6.00 | 1.00 | 0.00 | 2.00 | 1.50 | 0.50 | 0.25 | 0.75 | 0.10 | 0.00 | 0.00 | 0.00 | 0.00 |" in text


def test_busy_falls_back_to_the_metrics_and_missing_logs_still_give_every_plot(tmp_path: Path) -> None:
    _write_run(tmp_path / "run", utilization=False, timeline=False)
    out = build_report(tmp_path / "run", tmp_path / "elsewhere")
    assert out == tmp_path / "elsewhere"
    assert "| gen-0 | 0.500 |" in (out / "report.md").read_text()
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path: Path) -> None:
    path = RunDir(tmp_path).metrics
    path.write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    with pytest.raises(ReportError, match=r"metrics\.jsonl:2"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n\n[1, 2]\n{"step": 3')  # blank lines, non-objects, a cut last line
    assert read_jsonl(path) == [{"step": 1}]


def test_a_run_dir_without_metrics_is_an_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"metrics\.jsonl: no such file"):
        build_report(tmp_path)


def test_cli_report_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    _write_run(tmp_path / "run", utilization=False, timeline=False)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert str(tmp_path / "out" / "report.md") in capsys.readouterr().out
    assert (tmp_path / "out" / "timeline.png").is_file()
