"""`bin/gpu-check`: its `--cpu-smoke` mode runs every row's code path (the real engines, the weight path
over loopback TCP, a tiny shape) here, and the wheels it installs on the GPU machine are the ones that
machine needs, listed with their checksums.

The GPU run itself needs a GPU; what it measures is in the script's docstring (benchmarks/gpu_check.py)
and its rows' (benchmarks/gpu_check_rows.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "tools" / "gpu-wheels"
ROWS = 8
TRAINING_ROWS = [0, 1, 6, 7]
GENERATE, PUSH, IPC, MEGATRON = 2, 3, 4, 5


# slow: minutes of the default test run on 2 cores; CI runs it (bin/test --all)
@pytest.mark.slow
@pytest.mark.integration
def test_the_cpu_smoke_run_measures_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.md"
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path / "ignored")}
    done = subprocess.run(
        [ROOT / "bin" / "gpu-check", "--cpu-smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("# GPU check"), done.stdout[:500]  # log lines go to stderr
    assert out.read_text() == done.stdout.rstrip("\n") + "\n"
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == ROWS and not any("failed" in row for row in rows), rows
    measured = json.loads(out.with_suffix(".json").read_text())
    assert [r["row"] for r in measured] == [row.split(" | ")[0].removeprefix("| ") for row in rows]
    for i in TRAINING_ROWS:
        row = measured[i]
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_bytes"] > 0, row
        assert row["state_bytes"] > 0 and row["export_s"] >= 0, row
    assert measured[0]["describe"]["backend"] == "fsdp2" and measured[1]["describe"]["backend"] == "torch"

    generated = measured[GENERATE]
    assert generated["generated_tokens"] > 0 and generated["tokens_per_s"] > 0 and generated["peak_bytes"] > 0
    assert generated["requests"] == 8 and generated["batches"] == 1, generated  # concurrent requests: one batch

    pushed = measured[PUSH]
    assert pushed["push_gib_s"] > 0 and pushed["push_bytes"] > 0 and pushed["step_s"] > 0, pushed
    assert pushed["greedy_match"] is True and pushed["changed"] is True, pushed  # the step changed the output
    assert "greedy match: true" in rows[PUSH] and re.search(r"\| \d+\.\d\d \| \d+ \|", rows[PUSH]), rows[PUSH]

    assert measured[IPC]["skipped"] == "CUDA IPC needs a CUDA GPU", measured[IPC]
    assert "CUDA" in measured[MEGATRON]["skipped"], measured[MEGATRON]
    assert "| skipped: " in rows[MEGATRON] and "- skipped: megatron" in done.stdout, rows[MEGATRON]


def test_the_gpu_machine_gets_wheels_for_what_it_lacks_and_they_are_small() -> None:
    """The GPU machine (python 3.12, x86_64) lacks msgspec, structlog, crc32c and zstandard, which the
    weight path and the configs import, looptime, which the CUDA tests' conftest imports, and
    megatron-core; the wheels travel with the working tree,
    which may carry 64 MiB in all. Each is listed in the folder's README with its sha256, and
    `bin/gpu-check` names it."""
    wheels = sorted(WHEELS.glob("*.whl"))
    names = [p.name.split("-")[0] for p in wheels]
    assert names == ["crc32c", "looptime", "megatron_core", "msgspec", "structlog", "zstandard"]
    for path in wheels:
        if path.name.startswith(("structlog", "looptime")):
            assert path.name.endswith("py3-none-any.whl")
        else:
            assert "-cp312-cp312-manylinux" in path.name and path.name.endswith("x86_64.whl"), path.name
    assert sum(p.stat().st_size for p in wheels) < 12 << 20
    readme = (WHEELS / "README.md").read_text()
    listed = dict(re.findall(r"^\| `([^`]+\.whl)` \| .* \| `([0-9a-f]{64})` \|$", readme, re.MULTILINE))
    assert listed == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in wheels}
    script = (ROOT / "bin" / "gpu-check").read_text()
    assert all(f":{name}" in script for name in names), names
