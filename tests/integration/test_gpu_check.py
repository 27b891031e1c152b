"""`bin/gpu-check`: its `--cpu-smoke` mode runs every row's code path (the real engines, a tiny shape) here,
and the wheels it installs on the GPU machine are the ones that machine needs.

The GPU run itself needs a GPU; what it measures is in the script's docstring (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "tools" / "gpu-wheels"
ROWS = 4


@pytest.mark.integration
def test_the_cpu_smoke_run_measures_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.md"
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path / "ignored")}
    done = subprocess.run(
        [ROOT / "bin" / "gpu-check", "--cpu-smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("# Trainer GPU check"), done.stdout[:500]  # log lines go to stderr
    assert out.read_text() == done.stdout.rstrip("\n") + "\n"
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == ROWS and not any("failed" in row for row in rows), rows
    measured = json.loads(out.with_suffix(".json").read_text())
    assert [r["row"] for r in measured] == [row.split(" | ")[0].removeprefix("| ") for row in rows]
    for row in measured:
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_bytes"] > 0, row
        assert row["state_bytes"] > 0 and row["export_s"] >= 0, row
    assert measured[0]["describe"]["backend"] == "fsdp2" and measured[2]["describe"]["backend"] == "torch"


def test_the_gpu_machine_gets_wheels_for_what_it_lacks_and_they_are_small() -> None:
    """The GPU machine (python 3.12, x86_64) lacks msgspec (a C extension) and structlog; the
    wheels travel with the working tree, which may carry 64 MiB in all."""
    wheels = sorted(p.name for p in WHEELS.glob("*.whl"))
    assert [name.split("-")[0] for name in wheels] == ["msgspec", "structlog"]
    assert "cp312-cp312-manylinux" in wheels[0] and "x86_64" in wheels[0]
    assert wheels[1].endswith("py3-none-any.whl")
    assert sum(p.stat().st_size for p in WHEELS.glob("*.whl")) < 2 << 20
