"""What both episode runners share, an environment's (`rollout.trajectory`) and an agent program's
(`rollart.agents.runner`): the context an env-host hands them, the one builder of a turn's `Generate`
request, and the token history the trainer needs.

The context is what the runner may know of its env-host: where turns are generated, how an episode is
scored, the policy version now and the oldest weights a turn may be served with (both asked at each
turn: they change while the episode runs), and whom to tell the version the episode started at (the
env-host aborts it once that is too stale). Everything else (the env, the agent endpoint, the group) is
the runner's own business.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rollart.protocol.messages import Generate, Generated, Score
from rollart.rollout.config import SamplingSpec
from rollart.rollout.render import ChatRenderer

Scorer = Callable[[Score], Awaitable[float]]
T = TypeVar("T")


class TurnRouter(Protocol):
    """Where an episode's turns are generated: the env-host's `LLMProxy` (a test's fake in tests)."""

    async def generate(self, task: str, request: Generate) -> Generated: ...

    def forget(self, trajectory_id: str) -> None:
        """The trajectory ended: none of its turns will look for its prefix again."""


def _no_one(version: int) -> None:
    pass


def _any_weights() -> int:
    return 0


@dataclass(frozen=True)
class EpisodeContext:
    """What an env-host gives the runner of one trajectory, env or agent."""

    renderer: ChatRenderer
    proxy: TurnRouter
    score: Scorer
    """Asks the reward gateway for the episode's reward."""
    policy_version: Callable[[], int]
    """The policy version the env-host knows now (an episode starts at it: `Trajectory.started_at_version`)."""
    on_start: Callable[[int], None] = _no_one
    """Called once, at the first generation call, with the version the episode starts at."""
    min_version: Callable[[], int] = _any_weights
    """The oldest weight version a generator may serve the next turn with (the staleness bound)."""


def turn_request(
    trajectory_id: str,
    turn: int,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingSpec,
    stop_ids: list[int],
    min_version: int,
    seed: int | None = None,
) -> Generate:
    """Turn `turn` (from 0) of a trajectory: the request `<trajectory>.t<turn>` for its generator."""
    return Generate(
        request_id=f"{trajectory_id}.t{turn}",
        trajectory_id=trajectory_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop_token_ids=stop_ids,
        seed=seed,
        min_version=min_version,
    )


@dataclass
class TurnHistory:
    """Every token after the first prompt, with what the trainer needs to know of each."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    generators: list[str] = field(default_factory=list)
    waited: dict[str, float] = field(default_factory=lambda: {"env": 0.0, "gen": 0.0, "reward": 0.0})
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    """Offsets in `ids` where a turn's fresh prompt starts (`context: last`)."""

    async def timed(self, kind: str, call: Awaitable[T]) -> T:
        """Await `call`, adding the wait to the trajectory's env, generation or reward time."""
        loop = asyncio.get_running_loop()  # its clock: simulated time on the in-process virtual loop
        t0, wall = loop.time(), time.time()
        try:
            return await call
        finally:
            took = loop.time() - t0
            self.waited[kind] += took
            self.spans.append((kind, round(wall, 4), round(wall + took, 4)))

    def record(self) -> dict[str, Any]:
        """The `Trajectory` fields this history fills: the tokens, their log-probs and versions, the waits."""
        return {
            "response_ids": self.ids,
            "response_mask": self.mask,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "env_wait_s": round(self.waited["env"], 6),
            "gen_wait_s": round(self.waited["gen"], 6),
            "generators": self.generators,
            "spans": self.spans,
            "segments": self.segments,
        }

    def generated(self, result: Generated, reply: str) -> None:
        self.ids += result.token_ids
        self.mask += [1] * len(result.token_ids)
        self.logprobs += result.logprobs
        self.versions += result.versions
        self.replies.append(reply)
        self.generators.append(result.generator)

    def context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def fresh_prompt(self, ids: list[int]) -> None:
        """A new, independent sequence starts here with prompt `ids` (`context: last`)."""
        self.segments.append(len(self.ids))
        self.context(ids)
