"""Where a training step's time went, read from its `metrics.jsonl` line.

The trainer's wall time from one step's line to the next is, in order: waiting for the batch to
fill (`time_wait_s`), the train step (`time_recompute_s`: no-grad forwards for pi_prox;
`time_forward_s`; `time_backward_s`: the loss and its backward; `time_optimizer_s`: clipping and
the optimizer, each summed over the step's passes), the weight export that holds it (`stall_s`:
ordering the export, the step's wait behind it, waiting for the packer), and the rest (bookkeeping, metrics,
checkpoints: `other`). The push and the generators' apply run beside the next step
(`time_push_s`, `time_apply_s`), as do the trajectories (per trajectory of the batch on average:
`traj_gen_s`, `traj_env_s`, `traj_reward_s`, out of `traj_s`). The progress line
(`rollart.launch.terminal`) and the run report (`rollart.report`) show them.
"""

from __future__ import annotations

from typing import Any

PARTS = {
    "wait": "time_wait_s",
    "recompute": "time_recompute_s",
    "forward": "time_forward_s",
    "backward": "time_backward_s",
    "optimizer": "time_optimizer_s",
    "export": "stall_s",
}
"""The trainer's parts of a step, in order: short name -> the metrics line's key."""
BESIDE = {
    "push": "time_push_s",
    "apply": "time_apply_s",
    "traj gen": "traj_gen_s",
    "traj env": "traj_env_s",
    "traj reward": "traj_reward_s",
}
"""What runs beside the trainer's steps: short name -> key."""


def parts(line: dict[str, Any], interval: float | None = None) -> dict[str, float]:
    """The step's parts in seconds (missing ones 0), plus `other`: what of `interval` (the seconds
    since the step before) none of them accounts for."""
    out = {name: float(line.get(key) or 0.0) for name, key in PARTS.items()}
    if interval is not None:
        out["other"] = max(0.0, interval - sum(out.values()))
    return out


def describe(line: dict[str, Any]) -> str:
    """One line for the terminal: the parts that took any time, and the push beside them."""
    taken = [f"{name} {seconds:.1f}" for name, seconds in parts(line).items() if seconds >= 0.05]
    push = float(line.get("time_push_s") or 0.0)
    beside = f" | push {push:.2f}" if push else ""
    return f"{' '.join(taken)} s{beside}" if taken else f"no time recorded{beside}"
