"""One trajectory, end to end: the coroutine an env-host runs per environment instance.

    reset(seed) -> render the prompt with the model's chat template -> LLMProxy.generate ->
    decode the action -> step -> render the observation as the next user turn -> ... ->
    score with the task's reward function on the reward gateway

It keeps the token-level history the trainer needs: the first prompt's ids, then every later
token with a mask that is 1 exactly on generated tokens, and each generated token's behaviour
log-prob and weight version. With the task's `context: last` every turn starts afresh from the
latest observation, and the history marks where each turn's prompt begins (`Trajectory.segments`),
so the trainer trains the turns as separate sequences. A trajectory stops when the environment
ends it, at the task's turn limit, or when the context would pass its token budget. Every environment call runs off
the event loop with a deadline, in a thread (`EnvRunner`) or an env worker process (`WorkerEnvRunner`), as the
env-host opened it; an environment that fails fails this trajectory only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollart.envs import EnvHandle
from rollart.errors import RollartError
from rollart.protocol.messages import Generate, Generated, Score, Trajectory
from rollart.rollout.barrier import TurnBarrier
from rollart.rollout.config import SamplingSpec, TaskSpec
from rollart.rollout.proxy import LLMProxy
from rollart.rollout.render import ChatRenderer

Scorer = Callable[[Score], Awaitable[float]]
T = TypeVar("T")


@dataclass
class TrajectoryJob:
    """What a trajectory needs to run."""

    trajectory_id: str
    group_id: str
    task: TaskSpec
    seed: int
    sampling: SamplingSpec
    env_timeout_s: float


class TrajectoryAborted(RollartError):
    """A generator aborted the turn (its request was cancelled there)."""


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


@dataclass
class _Conversation:
    """What each turn is prompted with (the task's `context`): the conversation as it happened (`full`), as
    the chat template renders it (`template`), or the system prompt and the latest observation (`last`)."""

    renderer: ChatRenderer
    task: TaskSpec
    system: str
    messages: list[dict[str, str]]
    first: list[int]
    """The first prompt's ids."""
    current: list[int]
    """This turn's prompt when it starts a sequence of its own."""
    since: int = 0
    """Where in the history the current sequence's tokens after `current` begin."""

    def prompt(self, history: TurnHistory) -> list[int]:
        if self.task.context == "full":
            return self.first + history.ids
        return self.current + history.ids[self.since :]

    def advance(self, history: TurnHistory, reply: str, generated: list[int], observation: str, *, more: bool) -> None:
        """Add what follows `reply` to `history`; `more`: another turn follows (a fresh prompt needs one)."""
        options = self.task.chat_options()
        if self.task.context == "last":
            self.messages, fresh = self.renderer.first_prompt(self.system, observation, options)
        else:
            turn = self.renderer.next_turn(
                self.messages,
                reply,
                generated,
                observation,
                as_template=self.task.context == "template",
                options=options,
            )
            if not turn.fresh:
                history.context(turn.ids)
                return
            fresh = turn.ids
        if more:  # no prompt without a reply to train on
            self.current = fresh
            history.fresh_prompt(fresh)
            self.since = len(history.ids)


async def run_trajectory(
    job: TrajectoryJob,
    *,
    env: EnvHandle,
    renderer: ChatRenderer,
    proxy: LLMProxy,
    score: Scorer,
    policy_version: Callable[[], int],
    on_start: Callable[[int], None] = lambda version: None,
    barrier: TurnBarrier | None = None,
    min_version: Callable[[], int] = lambda: 0,
) -> Trajectory:
    """Run one episode in `env` (opened for this trajectory; closed here however it ends) and
    return it scored. Raises `EnvFailure`, `GenerationFailed`, ...

    `min_version` gives the oldest weight version a generator may use (the staleness bound)."""
    task = job.task
    runner = env
    if barrier is not None:
        barrier.join()
    started_at = time.time()
    history = TurnHistory()
    try:
        observation, info = await history.timed("env", runner.reset(job.seed))
        system = task.system_for(env.system_prompt)
        messages, prompt_ids = renderer.first_prompt(system, observation, task.chat_options())
        prompt_text = renderer.render(messages, generation_prompt=True, options=task.chat_options())
        talk = _Conversation(renderer, task, system, messages, prompt_ids, prompt_ids)
        started_at_version: int | None = None
        env_reward, turns, finish = 0.0, 0, "max-turns"
        max_turns = task.max_turns or env.max_turns
        while turns < max_turns:
            context = talk.prompt(history)
            budget = min(task.max_tokens_per_turn, task.max_total_tokens - len(context))
            if budget <= 0:
                finish = "max-tokens"
                break
            if barrier is not None:
                await barrier.wait()  # batch-level stepping: the whole batch finished the last turn
            if started_at_version is None:
                started_at_version = policy_version()
                on_start(started_at_version)
            request = Generate(
                request_id=f"{job.trajectory_id}.t{turns}",
                trajectory_id=job.trajectory_id,
                prompt_ids=context,
                max_tokens=budget,
                temperature=job.sampling.temperature,
                top_p=job.sampling.top_p,
                stop_token_ids=renderer.stop_ids,
                min_version=min_version(),
            )
            result = await history.timed("gen", proxy.generate(task.name, request))
            if result.finish_reason == "abort":
                raise TrajectoryAborted(f"{request.request_id} was aborted on {result.generator}")
            reply = renderer.decode(result.token_ids)
            history.generated(result, renderer.answer(reply))
            observation, reward, terminated, truncated, info = await history.timed(
                "env", runner.step(renderer.answer(reply))
            )
            env_reward += reward
            turns += 1
            if terminated or truncated:
                finish = "done" if terminated else "max-turns"
                break
            talk.advance(history, reply, result.token_ids, observation, more=turns < max_turns)
        answer = info.get("answer")
        reward = await history.timed(
            "reward",
            score(
                Score(
                    fn=task.reward,
                    task=task.name,
                    prompt=prompt_text,
                    response="\n".join(history.replies),
                    answer=str(answer) if answer is not None else None,
                    env_reward=env_reward,
                    tokens=len(history.ids),
                )
            ),
        )
    finally:
        if barrier is not None:
            barrier.leave()
        proxy.forget(job.trajectory_id)
        await runner.close()
    return Trajectory(
        trajectory_id=job.trajectory_id,
        group_id=job.group_id,
        task=task.name,
        seed=job.seed,
        prompt_ids=prompt_ids,
        reward=reward,
        env_reward=env_reward,
        turns=turns,
        finish=finish,
        started_at_version=started_at_version if started_at_version is not None else policy_version(),
        started_at=started_at,
        finished_at=time.time(),
        success=bool(info.get("success", False)),
        **history.record(),
    )
