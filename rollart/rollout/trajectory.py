"""One trajectory, end to end: the coroutine an env-host runs per environment instance.

    reset(seed) -> render the prompt with the model's chat template -> LLMProxy.generate ->
    decode the action -> step -> render the observation as the next user turn -> ... ->
    score with the task's reward function on the reward gateway

It keeps the token-level history the trainer needs (`rollout.turns.TurnHistory`): the first prompt's ids,
then every later token with a mask that is 1 exactly on generated tokens, and each generated token's behaviour
log-prob and weight version. With the task's `context: last` every turn starts afresh from the
latest observation, and the history marks where each turn's prompt begins (`Trajectory.segments`),
so the trainer trains the turns as separate sequences. A trajectory stops when the environment
ends it, at the task's turn limit, or when the context would pass its token budget. Every environment call runs off
the event loop with a deadline, in a thread (`EnvRunner`) or an env worker process (`WorkerEnvRunner`), as the
env-host opened it; an environment that fails fails this trajectory only. What it knows of its env-host is its
`EpisodeContext` (`rollout.turns`), the same an agent episode is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rollart.envs import EnvHandle
from rollart.errors import RollartError
from rollart.protocol.messages import Score, Trajectory
from rollart.rollout.barrier import TurnBarrier
from rollart.rollout.config import SamplingSpec, TaskSpec
from rollart.rollout.render import ChatRenderer
from rollart.rollout.turns import EpisodeContext, TurnHistory, turn_request


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
    job: TrajectoryJob, env: EnvHandle, context: EpisodeContext, *, barrier: TurnBarrier | None = None
) -> Trajectory:
    """Run one episode in `env` (opened for this trajectory; closed here however it ends) and
    return it scored. Raises `EnvFailure`, `GenerationFailed`, ...

    `barrier`: batch-level stepping (`rollout.barrier`), each turn waits for the whole batch."""
    task, renderer, proxy = job.task, context.renderer, context.proxy
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
            prompt = talk.prompt(history)
            budget = min(task.max_tokens_per_turn, task.max_total_tokens - len(prompt))
            if budget <= 0:
                finish = "max-tokens"
                break
            if barrier is not None:
                await barrier.wait()  # batch-level stepping: the whole batch finished the last turn
            if started_at_version is None:
                started_at_version = context.policy_version()
                context.on_start(started_at_version)
            request = turn_request(
                job.trajectory_id,
                turns,
                prompt,
                max_tokens=budget,
                sampling=job.sampling,
                stop_ids=renderer.stop_ids,
                min_version=context.min_version(),
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
            context.score(
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
        started_at_version=started_at_version if started_at_version is not None else context.policy_version(),
        started_at=started_at,
        finished_at=time.time(),
        success=bool(info.get("success", False)),
        **history.record(),
    )
