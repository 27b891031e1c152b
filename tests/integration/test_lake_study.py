"""benchmarks/lake_study.py runs as its docstring says: one JSON line per seed, and `--report` reads them
back (a seed fixes the run: the same seed gives the same line). The study itself is in
benchmarks/results/lake_study; this checks the script, on the test's tiny model (about 25 s here: slow, run by CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# slow: minutes of the default test run on 2 cores; CI runs it (bin/test --all)
@pytest.mark.slow
def test_lake_study_runs_a_seed_reproducibly_and_reports_it(tmp_path: Path, tiny_model: Path) -> None:
    command = [sys.executable, "benchmarks/lake_study.py", "--steps", "2", "--seeds", "3", "--model", str(tiny_model)]
    lines = []
    for _ in range(2):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        lines.append(done.stdout.strip())
    first = json.loads(lines[0])
    assert first["seed"] == 3 and first["steps"] == 2 and first["model"] == str(tiny_model)
    assert 0.0 <= first["lake_last20"] <= 1.0
    assert {k: v for k, v in json.loads(lines[1]).items() if k != "seconds"} == {
        k: v for k, v in first.items() if k != "seconds"
    }
    results = tmp_path / "runs.jsonl"
    results.write_text(lines[0] + "\n")
    report = [sys.executable, "benchmarks/lake_study.py", "--report", f"{results}=untrained", "--by", "2"]
    table = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| as configured (model: untrained) | 1 | 3 |" in table
