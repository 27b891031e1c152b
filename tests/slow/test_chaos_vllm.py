"""Fault injection with vLLM generators: kill -9 of a generator (its vLLM engine with it) during a
training run, again and again (rollart/testkit/harness.py). The launcher restarts it, the engine starts
again and loads the trainer's current weights, and the run completes with nothing lost or trained
twice. Needs vLLM: run bin/setup-vllm, then `.venv-vllm/bin/python -m pytest tests/slow` (CI does).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollart.testkit.harness import ChaosRun
from rollart.testkit.outcome import Scenario

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def test_a_training_run_with_vllm_generators_survives_their_kills(tmp_path: Path, tiny_model: Path) -> None:
    # A vLLM generator takes 30-50 s to start again on 2 cores, as long as 50 steps of this run.
    scenario = Scenario("vllm", ("kill-generator",), steps=120, quiet_steps=80, backend="vllm")
    outcome = asyncio.run(ChaosRun(scenario, tmp_path, tiny_model).run())
    report = "\n".join(f"{i.kind} on {i.target}: recovery {i.recovery_s}" for i in outcome.injections)
    assert outcome.ok, f"{outcome.explain()}\n{report}\nrun folder {tmp_path}"
    assert outcome.injections, "no generator was killed: the run ended first"
    assert outcome.lost == 0 and outcome.duplicated == 0, report
