"""Faults injected into a real training run (rollart/testkit/harness.py): every kind, one after another
in one run, with flaky environments and crashing reward workers throughout, drained 10 steps after
the last fault was recovered from (a fixed step count ran out before the last fault on a faster
machine). Nothing may be lost or trained twice, alpha kept, versions increasing, every fault
recovered from and every node healthy at the end. Slow: about two minutes here. The table of
each kind on its own is benchmarks/chaos.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollart.testkit.harness import CONTINUOUS, FAULTS, ChaosRun
from rollart.testkit.outcome import NEEDS_RANKS, Scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_training_run_survives_every_kind_of_fault(tmp_path: Path, tiny_model: Path) -> None:
    """Every kind but those of a trainer with rank processes (test_rank_kill.py's)."""
    faults = tuple(kind for kind in FAULTS if kind not in NEEDS_RANKS)
    kinds = [kind for kind in faults if kind not in CONTINUOUS]
    scenario = Scenario("mixed", faults, steps=None, injections=len(kinds), gap_s=(1.0, 4.0))
    outcome = asyncio.run(ChaosRun(scenario, tmp_path, tiny_model).run())
    report = (
        "\n".join(f"{i.kind} on {i.target}: recovery {i.recovery_s}" for i in outcome.injections)
        + f"\ncontinuous: {dict(outcome.continuous)}; run folder {tmp_path}"
    )
    assert outcome.ok, f"{outcome.explain()}\n{report}"
    assert [i.kind for i in outcome.injections] == kinds, report
    assert outcome.continuous["env-faults"] > 0 and outcome.continuous["reward-crash"] > 0, report
    assert outcome.lost == 0 and outcome.duplicated == 0, report
