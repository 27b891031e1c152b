"""The rollout channel: generation, group tasks, trajectories, policy versions, weights and rewards.

Who sends what to whom is in each message's docstring; a request (`Request[reply]`) names the
message its peer answers with, so `Session.request` returns that type.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollart.protocol.messages.channel import WIRE as _WIRE
from rollart.protocol.messages.channel import Request


class Generate(Request["Generated"], tag="gen", **_WIRE):
    """Env-host -> generator: generate one turn of one trajectory."""

    request_id: str
    trajectory_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = []  # noqa: RUF012 (msgspec copies a mutable default; ruff sees no Struct base)
    seed: int | None = None
    min_version: int = 0
    """Serve with weights of this version or newer (the trainer's version minus alpha): a generator
    still on older weights waits for the push (within the request's deadline)."""
    prefill_only: bool = False
    """`rollout.routing: disaggregated`: prefill only, the KV cache handed to the generator that decodes."""
    kv_from: str | None = None
    """`rollout.routing: disaggregated`: decode only, the prompt's KV cache from this prefill (generator/request)."""


class Generated(msgspec.Struct, tag="generated", **_WIRE):
    """Generator -> env-host: the turn's tokens, their behaviour log-probs and weight versions."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int
    generator: str
    queued_s: float = 0.0
    """Seconds the request waited on the generator before it started (0: the engine does not say)."""
    running: int = 0
    """Requests running on the generator when it answered (its engines' `EngineLoad`)."""
    waiting: int = 0
    """Requests queued there, not yet started, when it answered."""
    busy: float | None = None
    """The fraction of its recent time (the last 10-20 s) its engines spent generating (None: not said)."""


class TaskWanted(Request["GroupTask | NoTask"], tag="task?", **_WIRE):
    """Env-host -> trainer: a slot is free; give it a group (the trainer may wait, then say no)."""

    env_host: str
    wait_s: float = 5.0


class GroupTask(msgspec.Struct, tag="group-task", **_WIRE):
    """Trainer -> env-host: run G + R trajectories of `task` on environment seed `seed`."""

    group_id: str
    task: str
    seed: int
    group_size: int
    redundancy: int
    version: int
    """The trainer's policy version when the group was granted."""
    greedy: int = 0
    """The first `greedy` trajectories sample at temperature 0, the rest as the run samples."""
    evaluation: bool = False
    """A held-out evaluation's group (`rollart.rollout.evaluation`): never trained on, never aborted as stale."""
    min_size: int = 0
    """Past its deadline the group may finish with this many trajectories (`rollout.min_group_size`); 0: G."""


class NoTask(msgspec.Struct, tag="no-task", **_WIRE):
    """Trainer -> env-host: nothing to run now (alpha admission, paused, or the run is done)."""

    reason: str
    done: bool = False


class Trajectory(msgspec.Struct, tag="trajectory", **_WIRE):
    """One finished trajectory, token by token.

    `response_ids` holds everything after the first prompt: generated tokens and the later
    observations; `response_mask` is 1 exactly on generated tokens, and `logprobs` / `versions`
    hold their behaviour log-prob and weight version (0.0 / -1 elsewhere).
    """

    trajectory_id: str
    group_id: str
    task: str
    seed: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    env_reward: float
    turns: int
    finish: str
    """done (the environment ended it), max-turns or max-tokens."""
    started_at_version: int
    """The trainer's policy version when the trajectory made its first generation call."""
    started_at: float
    finished_at: float
    env_wait_s: float
    gen_wait_s: float
    generators: list[str] = []
    success: bool = False
    """The environment said the episode was solved (`info["success"]`)."""
    spans: list[tuple[str, float, float]] = []
    """(kind, start, end) wall-clock times of each env call ("env"), generation ("gen") and the
    reward ("reward"): what the run report's trajectory timeline draws."""
    segments: list[int] = []
    """Offsets in `response_ids` where a new, independent sequence starts (a task with
    `context: last` gives each turn a fresh prompt: the prompt's ids, then the reply). Empty: the
    whole trajectory is one sequence."""


class GroupDone(Request["GroupAck"], tag="group", **_WIRE):
    """Env-host -> trainer: the first G finished trajectories of a group (fewer when it was cut at its deadline)."""

    group_id: str
    trajectories: list[Trajectory]
    cancelled: int = 0
    failed: int = 0
    cut: int = 0
    """Of `cancelled`, the trajectories cut at the group's deadline (`GroupTask.min_size`)."""


class GroupFailed(Request["GroupAck"], tag="group-failed", **_WIRE):
    """Env-host -> trainer: the group cannot reach G; re-issue it."""

    group_id: str
    reason: str


class GroupAck(msgspec.Struct, tag="group-ack", **_WIRE):
    """Trainer -> env-host: whether the group was taken into the SampleBuffer."""

    accepted: bool
    reason: str = ""


class PolicyVersion(msgspec.Struct, tag="version", **_WIRE):
    """Trainer -> env-hosts: the policy is at `version`; abort what started before `min_start`."""

    version: int
    min_start: int
    done: bool = False
    """The run is over: abort everything in flight and ask for no more work."""


class Score(Request["Scored"], tag="score", **_WIRE):
    """Env-host -> reward gateway: score one trajectory with reward function `fn`."""

    fn: str
    task: str
    prompt: str
    response: str
    answer: str | None = None
    env_reward: float | None = None
    tokens: int = 0
    """The trajectory's prompt and response tokens (what a simulated reward model's time follows)."""
    timeout_s: float = 0.0
    """How long the asking run waits for it (its `rollout.reward_timeout_s`): the gateway gives up
    then too, whatever its own run's setting (a gateway shared by runs); 0: the gateway's own."""


class Scored(msgspec.Struct, tag="scored", **_WIRE):
    """Reward gateway -> env-host: the reward and what the function reported."""

    reward: float
    details: dict[str, Any] = {}


class WeightsWhere(Request["WeightsHere"], tag="weights?", **_WIRE):
    """Trainer -> generator: where and how do I push you weights?"""


class WeightsHere(msgspec.Struct, tag="weights", **_WIRE):
    """Generator -> trainer: the version it holds, its UCX receiver's port (0: TCP bulk only, to the
    session port), and the dtype its weights should arrive in."""

    version: int
    ucx_port: int = 0
    dtype: str = ""
    """The dtype its engine runs floating-point weights in (`float32`, `bfloat16`): what they travel
    in; empty: as the trainer holds them."""


class SimWeights(Request["SimWeights"], tag="sim-weights", **_WIRE):
    """Trainer -> generator, simulation mode: policy `version` reaches the engine `after_s` simulated
    seconds from now, and loading it stops generation for `pause_s`. Answered (with itself) once loaded."""

    version: int
    after_s: float
    pause_s: float


RolloutMsg = (
    Generate
    | Generated
    | TaskWanted
    | GroupTask
    | NoTask
    | GroupDone
    | GroupFailed
    | GroupAck
    | PolicyVersion
    | WeightsWhere
    | WeightsHere
    | SimWeights
)
RewardMsg = Score | Scored
