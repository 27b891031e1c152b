"""Format warm-up: teach a model built from scratch the reply format of the run's tasks and the rules of
motion, never a solution.

A randomly initialized model almost never produces a parseable action (`U`, `\\boxed{...}`), so
RL from scratch first spends its time learning the format. Real RL starts from an instruct model
that already has it; the tiny model gets it here, in a few supervised steps on episodes played by
a **uniformly random valid policy** (`Env.sample_action`: right format, random content; on a grid,
a random move among those that move, so the edges and walls count and the holes, goal, box and
target never do). The targets never depend on the answer or on where the goal is, so the warm-up
teaches no solution: after it the model's success rate is the random policy's (the baseline the
trainer measures and prints).

On a grid the targets do depend on where the player stands, and that is on purpose: a warm-up
whose targets ignored the board left a model that ignored it too, and RL then had to discover by
chance that the board matters; in a seeded study that took from 45 steps to more than 100 (`benchmarks/
lake_study.py`, docs/training.md "Where the lake's plateau came from").

Episodes are rendered exactly as trajectories are (`ChatRenderer`), so the format learned is the
one the generators will be prompted with; the loss is on the reply tokens only.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from rollart.envs import make_env
from rollart.errors import ConfigError
from rollart.models.loading import load_model_and_tokenizer
from rollart.rollout.config import TaskSpec
from rollart.rollout.render import ChatRenderer
from rollart.tiny.model import MARKER_FILE

log = structlog.get_logger("rollart.warmup")

WARMUP_POLICY = "moves-that-move"
"""Names the random policy the warm-up plays (`format_warmup` records it in the model's marker): a
tiny model built and warmed up by an older RollArt, whose marker names another or none, is built
again (`warmup_outdated`)."""


Rows = list[tuple[list[int], Sequence[float]]]
"""Token-id sequences to train on, each with its mask of the tokens to learn (1, or another weight in the loss)
or only to read (0)."""


def random_episode(task: TaskSpec, renderer: ChatRenderer, rng: random.Random) -> Rows:
    """One episode of `task` under the random valid policy, as the trainer would see it: rows of
    token ids and the mask of reply tokens (a row per turn with `context: last`, a new one where
    `context: template` starts a sequence, else one)."""
    env = make_env(task.env, **task.env_kwargs)
    observation, _ = env.reset(rng.randrange(2**31))
    system = task.system_for(env.system_prompt)
    options = task.chat_options()
    messages, ids = renderer.first_prompt(system, observation, options)
    mask = [0] * len(ids)
    rows = [(ids, mask)]
    stop = renderer.turn_end_id
    for _ in range(task.max_turns or env.max_turns):
        reply = env.sample_action(rng)
        if reply is None:
            raise ValueError(f"task {task.name!r}: env {task.env!r} has no sample_action; it cannot be warmed up")
        generated = renderer.encode(reply)
        if stop is not None and len(generated) < task.max_tokens_per_turn:
            generated.append(stop)  # the model ends its turn itself unless the token budget ends it
        if len(ids) + len(generated) > task.max_total_tokens:
            break
        ids += generated
        mask += [1] * len(generated)
        observation, _, terminated, truncated, _ = env.step(reply)
        if terminated or truncated:
            break
        if task.context == "last":
            messages, ids = renderer.first_prompt(system, observation, options)
        else:
            turn = renderer.next_turn(
                messages, reply, generated, observation, as_template=task.context == "template", options=options
            )
            if not turn.fresh:
                ids += turn.ids
                mask += [0] * len(turn.ids)
                continue
            ids = turn.ids
        mask = [0] * len(ids)
        rows.append((ids, mask))
    return [(ids, mask) for ids, mask in rows if any(mask)]


def format_warmup(
    model_dir: Path, tasks: Sequence[TaskSpec], *, steps: int, episodes: int = 16, lr: float = 2e-3, seed: int = 0
) -> dict[str, Any]:
    """Train the model in `model_dir` for `steps` steps on random valid episodes; save it in place."""

    def batch(renderer: ChatRenderer, rng: random.Random) -> Rows:
        # Every task equally often, whatever the training mix: each has its own format to learn.
        return [row for i in range(episodes) for row in random_episode(tasks[i % len(tasks)], renderer, rng)]

    about = {
        "episodes_per_step": episodes,
        "tasks": [task.name for task in tasks],
        "what": "supervised steps on episodes of a uniformly random valid policy (format and moves, never a solution)",
        "policy": WARMUP_POLICY,
    }
    return supervised_warmup(model_dir, batch, steps=steps, lr=lr, seed=seed, about=about)


def supervised_warmup(
    model_dir: Path,
    batch: Callable[[ChatRenderer, random.Random], Rows],
    *,
    steps: int,
    lr: float,
    seed: int = 0,
    about: Mapping[str, Any],
    log_every: int = 10,
) -> dict[str, Any]:
    """Train the model in `model_dir` for `steps` steps, each on the rows `batch` makes (token ids, and the mask
    of the tokens to learn: the loss is on those alone); save it in place, and record the summary (with
    `about`, which says what was taught) in its marker file as `format_warmup`."""
    model, tokenizer = load_model_and_tokenizer(model_dir)
    model.train()
    renderer = ChatRenderer(tokenizer)  # type: ignore[arg-type]  # HF's decode is wider than the Protocol's
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = int(tokenizer.pad_token_id or 0)
    started, loss_value = time.monotonic(), float("nan")
    for step in range(steps):
        rows = batch(renderer, rng)
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), pad)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.zeros((len(rows), width))
        for i, (ids, mask) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
            targets[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * targets[:, 1:]).sum() / targets[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        loss_value = loss.item()
        if step % log_every == 0 or step == steps - 1:
            log.info("warmup.step", step=step + 1, steps=steps, loss=round(loss_value, 4))
    model.eval()  # type: ignore[no-untyped-call]
    model.save_pretrained(model_dir)
    summary = {
        "steps": steps,
        "lr": lr,
        "final_loss": round(loss_value, 4),
        "seconds": round(time.monotonic() - started, 1),
        **about,
    }
    marker_path = model_dir / MARKER_FILE
    marker = json.loads(marker_path.read_text()) if marker_path.exists() else {}
    if "format_warmup" in marker:  # warmed up again: the earlier warm-ups stay on record, oldest first
        previous = marker["format_warmup"]
        summary["earlier"] = [*previous.pop("earlier", []), previous]
    marker["format_warmup"] = summary
    marker_path.write_text(json.dumps(marker, indent=2) + "\n")
    return summary


def warmup_outdated(model_dir: Path) -> str | None:
    """Why the tiny model in `model_dir` must be built again, or None: its marker says RollArt built
    and warmed it up with another random policy than today's. A model without a marker (not built
    here) or without a warm-up is left alone."""
    marker_path = model_dir / MARKER_FILE
    if not marker_path.exists():
        return None
    warmup = json.loads(marker_path.read_text()).get("format_warmup")
    if warmup is None or warmup.get("policy") == WARMUP_POLICY:
        return None
    return f"its format warm-up played {warmup.get('policy', 'uniformly random moves')!r}, not {WARMUP_POLICY!r}"


def random_policy_baselines(tasks: Sequence[TaskSpec], *, seed: int) -> dict[str, dict[str, float]]:
    """`random_policy_baseline` of each task that has one, by task name. A task whose env is not registered here
    (a user's env: `run.env_modules` registers it on env-hosts only) is skipped, with a log line saying so."""
    baseline = {}
    for task in tasks:
        try:
            measured = random_policy_baseline(task, seed=seed)
        except ConfigError as exc:
            log.info("learner.no_baseline", task=task.name, reason=str(exc))
            continue
        if measured is not None:
            baseline[task.name] = measured
            log.info("learner.baseline", task=task.name, policy="uniformly random valid actions", **measured)
    return baseline


def random_policy_baseline(
    task: TaskSpec, *, episodes: int = 1000, seed: int = 0, max_seconds: float = 10.0
) -> dict[str, float] | None:
    """Success rate and mean env reward of the uniformly random valid policy on `task`, over `episodes`
    episodes or as many as `max_seconds` allow (a slow env must not hold up training; the count is in
    the result); None when the env has no `sample_action`, or no episode could be played. An episode
    whose env raises is left out and counted in `failed`: a flaky env must not stop the trainer. (The
    reward is the environment's own; a task scored by another reward function may differ.)"""
    rng = random.Random(seed)
    successes, total, played, failed = 0, 0.0, 0, 0
    deadline = time.monotonic() + max_seconds
    while played + failed < episodes and (played + failed == 0 or time.monotonic() < deadline):
        env = make_env(task.env, **task.env_kwargs)
        try:
            env.reset(rng.randrange(2**31))
            info: dict[str, Any] = {}
            rewards = 0.0
            for _ in range(task.max_turns or env.max_turns):
                reply = env.sample_action(rng)
                if reply is None:
                    return None
                _, reward, terminated, truncated, info = env.step(reply)
                rewards += reward
                if terminated or truncated:
                    break
        except Exception:  # the env's own failure: this episode does not count
            failed += 1
            continue
        finally:
            env.close()
        total += rewards
        successes += bool(info.get("success", False))
        played += 1
    if played == 0:
        return None
    return {
        "success_rate": successes / played,
        "reward_mean": total / played,
        "episodes": float(played),
        "failed": float(failed),
    }
