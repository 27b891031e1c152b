"""Shared by the paper experiments: write a simulation-mode topology, run it with real node
processes (`rollart run`), and read back what happened in simulated seconds.

Every experiment runs the real trainer (dispenser, SampleBuffer, alpha), env-hosts (trajectory
coroutines or batch-level stepping, LLMProxy routing) and reward gateway, with `sim` generators
and `sim` environments (docs/simulation.md). Times in the run's logs are real seconds; they are
multiplied by the speedup to give simulated seconds.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout import free_ports  # noqa: E402 - benchmarks/rollout.py


@dataclass
class Result:
    """One run, in simulated seconds."""

    step_s: list[float]
    """Time between consecutive batches handed to the trainer (the first batch left out: start-up)."""
    trajectories: list[dict[str, Any]]
    """Every trajectory of the batches taken (rollout.jsonl)."""
    versions: list[int]
    """The policy version (batch index) each trajectory was taken at."""
    speedup: float

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)


def tiny_tokenizer_model() -> Path:
    """The tiny model whose tokenizer renders prompts (its weights are never used in simulation)."""
    from rollart.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(ROOT / ".cache" / "models" / "tiny-qwen3", seed=0)


def run(
    run_spec: dict[str, Any], nodes: list[dict[str, Any]], *, timeout_s: float = 1800, keep: Path | None = None
) -> Result:
    """Run a topology whose `run` section is `run_spec` and whose nodes are `nodes` (ports are added);
    the run directory goes to `keep` when given, else it is deleted."""
    with tempfile.TemporaryDirectory(prefix="rollart-paper-") as tmp:
        folder = keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * len(nodes))
        placed = [node | {"port": ports[2 * i], "admin_port": ports[2 * i + 1]} for i, node in enumerate(nodes)]
        spec = {
            "run": {"name": "paper", "run_dir": str(folder / "run"), "drain_timeout_s": 5} | run_spec,
            "nodes": placed,
        }
        path = folder / "topology.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
        result = subprocess.run(
            [sys.executable, "-m", "rollart.cli", "run", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        run_dir = folder / "run"
        if result.returncode != 0:
            raise SystemExit(f"run failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        speedup = float(run_spec.get("sim", {}).get("speedup", 1.0))
        taken = [
            datetime.datetime.fromisoformat(event["timestamp"]).timestamp()
            for event in events(run_dir / "logs" / "trainer.log", "trainer.batch")
        ]
        steps = [(b - a) * speedup for a, b in itertools.pairwise(taken)]
        lines = (run_dir / "rollout.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        trajectories = [t for r in records for t in r["group"]["trajectories"]]
        versions = [r["version"] for r in records for _ in r["group"]["trajectories"]]
        return Result(steps, trajectories, versions, speedup)


def events(log: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            found.append(json.loads(line))
    return found
