"""Faults injected into a real training run (rollart/testkit/harness.py): every kind, one after another
in one run, with flaky environments and crashing reward workers throughout, drained 10 steps after
the last fault was recovered from (a fixed step count ran out before the last fault on a faster
machine). Nothing may be lost or trained twice, alpha kept, versions increasing, every fault
recovered from and every node healthy at the end; once in plaintext, once over TLS. Slow: about two
minutes each here. The table of each kind on its own is benchmarks/chaos.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollart.testkit.harness import CONTINUOUS, FAULTS, ChaosRun
from rollart.testkit.outcome import NEEDS_RANKS, Scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_a_training_run_survives_every_kind_of_fault(tls: bool, tmp_path: Path, tiny_model: Path) -> None:
    """Every kind but those of a trainer with rank processes (test_rank_kill.py's). With `tls`, every
    session, weight push and admin call goes over TLS 1.3 (certificates made for the run), and the
    partition is left out: its proxy reads each connection's role from its plaintext Hello."""
    faults = tuple(kind for kind in FAULTS if kind not in NEEDS_RANKS and not (tls and kind == "partition"))
    kinds = [kind for kind in faults if kind not in CONTINUOUS]
    scenario = Scenario("tls" if tls else "mixed", faults, steps=None, injections=len(kinds), gap_s=(1.0, 4.0), tls=tls)
    outcome = asyncio.run(ChaosRun(scenario, tmp_path, tiny_model).run())
    report = (
        "\n".join(f"{i.kind} on {i.target}: recovery {i.recovery_s}" for i in outcome.injections)
        + f"\ncontinuous: {dict(outcome.continuous)}; run folder {tmp_path}"
    )
    print(report)
    assert outcome.ok, f"{outcome.explain()}\n{report}"
    assert [i.kind for i in outcome.injections] == kinds, report
    assert outcome.continuous["env-faults"] > 0 and outcome.continuous["reward-crash"] > 0, report
    assert outcome.lost == 0 and outcome.duplicated == 0, report
