"""Run every experiment of `benchmarks/paper/`, one after another, each writing its table to
`benchmarks/results/paper/` with the command that made it.

    .venv/bin/python benchmarks/paper/run_all.py                 # all; about an hour on 2 cores
    .venv/bin/python benchmarks/paper/run_all.py fig11a fig14    # some (names as in the list below)
    .venv/bin/python benchmarks/paper/run_all.py --inprocess     # all in-process (about 25 minutes)

`--inprocess` runs the experiments that default to real node processes (Fig. 10, 12a, 12b, 13) on
the in-process virtual clock instead, writing `*-inprocess.md` beside their multi-process results.

One at a time on purpose: the multi-process experiments need the machine to themselves (a host
that falls behind stretches their simulated time). A failing experiment is reported and the rest
still run; the exit code is the number of failures.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MULTI_PROCESS = {"fig10", "fig12a", "fig12b", "fig13"}
"""The experiments that run real node processes unless given --inprocess."""
EXPERIMENTS = {
    "fig10": "fig10_end_to_end.py",
    "fig11a": "fig11a_affinity.py",
    "fig11b": "fig11b_weight_sync.py",
    "fig11b-relay": "fig11b_relay.py",
    "fig11b-transports": "fig11b_transports.py",
    "fig12a": "fig12a_env_handling.py",
    "fig12b": "fig12b_redundancy.py",
    "fig13": "fig13_alpha.py",
    "fig14": "fig14_reward_service.py",
    "scale": "scale.py",
}


def main(argv: list[str]) -> int:
    inprocess = "--inprocess" in argv
    argv = [arg for arg in argv if arg != "--inprocess"]
    unknown = [name for name in argv if name not in EXPERIMENTS]
    if unknown:
        print(f"unknown experiment(s) {unknown}; known: {', '.join(EXPERIMENTS)}", file=sys.stderr)
        return 2
    chosen = argv or list(EXPERIMENTS)
    outcomes = []
    for i, name in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {name}: {EXPERIMENTS[name]}", flush=True)
        began = time.monotonic()
        extra = ["--inprocess"] if inprocess and name in MULTI_PROCESS else []
        code = subprocess.run([sys.executable, str(HERE / EXPERIMENTS[name]), *extra], check=False).returncode
        outcomes.append((name, code, time.monotonic() - began))
    print("\n| experiment | exit | minutes |\n|---|---:|---:|")
    for name, code, seconds in outcomes:
        print(f"| {name} | {code} | {seconds / 60:.1f} |")
    return sum(code != 0 for _, code, _ in outcomes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
