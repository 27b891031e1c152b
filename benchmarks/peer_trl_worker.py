"""The TRL side of `benchmarks/peer_trl.py`: TRL's `GRPOTrainer` on a RollArt topology's tasks, in `.venv-trl`.

peer_trl.py runs it (it can be run alone too, from the repository root):

    .venv-trl/bin/python benchmarks/peer_trl_worker.py --topology runs/bench-peer-trl/repeat.yaml \\
        --out runs/bench-peer-trl/trl-repeat.jsonl --rounds 80

It reads the topology file `bin/rollart run` trains on and takes from rollart (installed in this
environment) the environments, the reward functions and the chat renderer, so every prompt, reply
and reward is built by RollArt's own code: a prompt is `ChatRenderer.first_prompt` of the env's
observation (its token ids are checked against what TRL tokenizes), a reply is decoded with
`ChatRenderer.decode` and stepped in the env, and the reward is the task's registered function on
the same `ScoreInput` the reward gateway gets. Groups are drawn as RollArt's dispenser draws them
(tasks by weight from `random.Random(rollout.seed)`, env seeds `seed * 1_000_003 + 1, 2, ...`).

Two ways to train, both TRL's loss, optimizer, multi-pass reuse (`num_iterations`) and logging:

- a task set of one single-turn task (`repeat`): the stock trainer. A dataset of rendered prompts,
  one reward function, transformers generation inside TRL;
- anything else (the default mix: FrozenLake with `context: last`, plus `repeat`): TRL has no
  per-turn rows (its `rollout_func` returns one sequence per sample, its environments call tools), so
  `EpisodeGRPOTrainer` replaces `_generate_and_score_completions`: it plays each round's groups turn
  by turn with the model (`generate`, every live episode of a turn in one batch), makes one row per
  turn (the turn's own prompt and reply, as RollArt's trainer does), gives every row its episode's
  group advantage (TRL's formula) and hands TRL the same tensors its own method returns. With the
  topology's `dynamic_sampling` it plays waves of `batch_groups` groups until that many have
  rewards that differ (DAPO's dynamic sampling, RollArt's rule; a surplus is dropped, as DAPO's
  implementations drop it, where RollArt keeps it for its next batch) and trains on those, or
  hands out what it has once `max_uniform_batches` batches' worth of uniform groups were played;
  `--all-groups` trains on every group drawn instead, as stock TRL would.

Writes one JSON line per round (wall time, seconds since the first generation call, per task the
mean reward, success rate and count over every episode played) plus `event` lines: `ready` (model
and trainer built), `first_generation`, `done`.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import importlib
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from rollart.algorithms.selection import has_signal
from rollart.envs import import_env_modules, make_env
from rollart.rewards import ScoreInput, get_reward
from rollart.rollout.config import RolloutSpec, TaskSpec
from rollart.rollout.render import ChatRenderer
from rollart.topology import load_topology

TRL_ADV_EPS = 1e-4
"""What TRL adds to the group std before dividing (RollArt: 1e-6)."""


class RoundLog:
    """Per-round results as JSON lines; the clock starts at the first generation call."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")
        self.first_generation: float | None = None
        self.rounds = 0
        self.episodes: dict[str, list[tuple[float, bool]]] = collections.defaultdict(list)
        self.extra: dict[str, Any] = {}

    def write(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def mark_generation(self) -> None:
        if self.first_generation is None:
            self.first_generation = time.time()
            self.write({"event": "first_generation", "wall": self.first_generation})

    def clock(self) -> float:
        return 0.0 if self.first_generation is None else time.time() - self.first_generation

    def add(self, task: str, reward: float, success: bool) -> None:
        self.episodes[task].append((reward, success))

    def close_round(self) -> int:
        self.rounds += 1
        tasks = {
            name: {
                "reward_mean": sum(r for r, _ in done) / len(done),
                "success_rate": sum(s for _, s in done) / len(done),
                "count": len(done),
            }
            for name, done in sorted(self.episodes.items())
        }
        self.write({"round": self.rounds, "wall": time.time(), "clock_s": self.clock(), "tasks": tasks, **self.extra})
        self.episodes.clear()
        self.extra = {}
        return self.rounds


class GroupSource:
    """Tasks and env seeds in the order RollArt's dispenser draws them (`rollart.rollout.dispenser`)."""

    def __init__(self, rollout: RolloutSpec) -> None:
        self.tasks = rollout.tasks
        self.rng = random.Random(rollout.seed)
        self.next_seed = rollout.seed * 1_000_003

    def draw(self) -> tuple[TaskSpec, int]:
        task = self.rng.choices(self.tasks, weights=[t.weight for t in self.tasks])[0]
        self.next_seed += 1
        return task, self.next_seed


def score(
    task: TaskSpec, prompt: str, replies: list[str], info: dict[str, Any], *, env_reward: float, tokens: int
) -> tuple[float, bool]:
    """(reward, success) as `rollart.rollout.trajectory.run_trajectory` asks the reward gateway for them."""
    answer = info.get("answer")
    item = ScoreInput(
        task=task.name,
        prompt=prompt,
        response="\n".join(replies),
        answer=str(answer) if answer is not None else None,
        env_reward=env_reward,
        tokens=tokens,
    )
    return float(get_reward(task.reward)(item).reward), bool(info.get("success", False))


@dataclasses.dataclass
class Episode:
    """One trajectory played turn by turn, as `run_trajectory` plays it (`context: last` or one turn)."""

    task: TaskSpec
    env: Any
    system: str
    prompt_text: str
    context: list[int]
    info: dict[str, Any]
    max_turns: int
    rows: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list)
    replies: list[str] = dataclasses.field(default_factory=list)
    env_reward: float = 0.0
    done: bool = False
    reward: float = 0.0
    success: bool = False

    @classmethod
    def start(cls, task: TaskSpec, seed: int, renderer: ChatRenderer) -> Episode:
        env = make_env(task.env, **task.env_kwargs)
        observation, info = env.reset(seed)
        system = task.system_for(env.system_prompt)
        messages, ids = renderer.first_prompt(system, observation)
        max_turns = task.max_turns or env.max_turns
        if task.context != "last" and max_turns > 1:
            raise ValueError(f"task {task.name!r}: the TRL side plays context: last tasks and single-turn ones")
        prompt = renderer.render(messages, generation_prompt=True)
        return cls(task, env, system, prompt, ids, info, max_turns)

    def budget(self) -> int:
        return min(self.task.max_tokens_per_turn, self.task.max_total_tokens - len(self.context))

    def step(self, generated: list[int], renderer: ChatRenderer) -> None:
        reply = renderer.decode(generated)
        self.rows.append((self.context, generated))
        self.replies.append(reply)
        observation, reward, terminated, truncated, self.info = self.env.step(reply)
        self.env_reward += reward
        if terminated or truncated or len(self.rows) >= self.max_turns:
            self.done = True
        else:  # context: last, each turn prompted with the latest observation alone
            self.context = renderer.first_prompt(self.system, observation)[1]

    def finish(self) -> None:
        self.done = True
        tokens = sum(len(g) for _, g in self.rows) + sum(len(p) for p, _ in self.rows[1:])
        self.reward, self.success = score(
            self.task, self.prompt_text, self.replies, self.info, env_reward=self.env_reward, tokens=tokens
        )


class ClockedGRPOTrainer(GRPOTrainer):
    """The stock trainer; it only notes when it first generates."""

    round_log: RoundLog

    def _generate(self, prompts: list[Any]) -> Any:
        self.round_log.mark_generation()
        return super()._generate(prompts)


class EpisodeGRPOTrainer(ClockedGRPOTrainer):
    """GRPOTrainer whose batch is one row per turn of multi-turn episodes (module docstring)."""

    source: GroupSource
    rollout: RolloutSpec
    renderer: ChatRenderer
    train_all_groups: bool

    def _sample(self, contexts: list[list[int]], budget: int) -> list[list[int]]:
        """One reply per context, cut after its first stop token (which it keeps, as TRL does)."""
        self.round_log.mark_generation()
        pad_id = self.processing_class.pad_token_id
        ids = pad([torch.tensor(c) for c in contexts], padding_value=pad_id, padding_side="left")
        mask = pad([torch.ones(len(c), dtype=torch.long) for c in contexts], padding_value=0, padding_side="left")
        config = copy.deepcopy(self.generation_config)
        config.max_new_tokens = budget
        device = self.accelerator.device
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                generation_kwargs={**self.generation_kwargs, "max_new_tokens": budget},
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
        ):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        stops = set(self.eos_token_ids)
        replies = []
        for row in out[:, ids.shape[1] :].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            replies.append(row[:end])
        return replies

    def _play(self, draws: list[tuple[TaskSpec, int]]) -> list[list[Episode]]:
        """Play these groups to the end, every live episode's turn in one `generate` per token budget."""
        g = self.rollout.group_size
        groups = [[Episode.start(task, seed, self.renderer) for _ in range(g)] for task, seed in draws]
        live = [e for group in groups for e in group]
        while live:
            by_budget: dict[int, list[Episode]] = collections.defaultdict(list)
            for e in live:
                if e.budget() <= 0:
                    e.done = True
                else:
                    by_budget[e.budget()].append(e)
            for budget, episodes in sorted(by_budget.items()):
                for e, generated in zip(episodes, self._sample([e.context for e in episodes], budget), strict=True):
                    e.step(generated, self.renderer)
            live = [e for e in live if not e.done]
        for e in (e for group in groups for e in group):
            e.finish()
            self.round_log.add(e.task.name, e.reward, e.success)
        return groups

    def _collect(self) -> tuple[list[list[Episode]], int]:
        """The groups to train on, and how many were played without signal."""
        want = self.rollout.batch_groups
        dynamic = self.rollout.dynamic_sampling and not self.train_all_groups
        trained: list[list[Episode]] = []
        uniform: list[list[Episode]] = []
        while True:
            # Whole waves of `want` groups, as DAPO's implementations sample (a wave of the few groups still
            # missing would cost as many turns of `generate` as a whole one); the surplus is left out.
            for group in self._play([self.source.draw() for _ in range(want)]):
                signal = has_signal([e.reward for e in group])
                (trained if signal or not dynamic else uniform).append(group)
            if not dynamic or len(trained) >= want or len(uniform) >= self.rollout.max_uniform_batches * want:
                break
        # No signal anywhere: train on the uniform groups (zero advantage), TRL has no empty step.
        return trained[:want] or uniform[:want], len(uniform)

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """TRL's: reward minus the group mean, over the group's std (Bessel-corrected) + 1e-4."""
        centred = rewards - rewards.mean(dim=1, keepdim=True)
        if self.scale_rewards == "none":
            return centred
        if self.scale_rewards != "group":
            raise ValueError(f"scale_rewards {self.scale_rewards!r}: the episode trainer does group or none")
        return centred / (rewards.std(dim=1, keepdim=True) + TRL_ADV_EPS)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if self.beta != 0.0:
            raise ValueError("the episode trainer computes no reference log-probs; the topology's kl_coef must be 0")
        groups, uniform = self._collect()
        rewards = torch.tensor([[e.reward for e in group] for group in groups], dtype=torch.float32)
        advantages = self._advantages(rewards)
        prompts, completions, row_adv = [], [], []
        for group, group_adv in zip(groups, advantages.tolist(), strict=True):
            for e, advantage in zip(group, group_adv, strict=True):
                for prompt, generated in e.rows:
                    prompts.append(torch.tensor(prompt))
                    completions.append(torch.tensor(generated))
                    row_adv.append(advantage)
        self.round_log.extra = {"groups": len(groups), "uniform_groups": uniform, "rows": len(prompts)}
        self._metrics["train"]["reward"].append(rewards.mean().item())
        device = self.accelerator.device
        pad_id = self.processing_class.pad_token_id
        ones = [torch.ones(len(t), dtype=torch.long) for t in prompts]
        prompt_ids = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad(ones, padding_value=0, padding_side="left").to(device)
        ones = [torch.ones(len(t), dtype=torch.long) for t in completions]
        completion_ids = pad(completions, padding_value=pad_id, padding_side="right").to(device)
        completion_mask = pad(ones, padding_value=0, padding_side="right").to(device)
        output = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor(row_adv, device=device),
            "num_items_in_batch": completion_mask.sum(),
        }
        # As TRL: log-probs of the weights that generated, when the batch is used for more than one update.
        if self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) != 0:
            with torch.no_grad():
                output["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    torch.cat([prompt_ids, completion_ids], dim=1),
                    torch.cat([prompt_mask, completion_mask], dim=1),
                    completion_ids.size(1),
                    batch_size=self.args.per_device_train_batch_size,
                )
        return output


class Rounds(TrainerCallback):
    """Closes a round after its last optimizer step; stops at `rounds` or past the cap."""

    def __init__(self, log: RoundLog, steps_per_round: int, rounds: int, cap_s: float) -> None:
        self.log, self.steps_per_round, self.rounds, self.cap_s = log, steps_per_round, rounds, cap_s
        self.stopped = "rounds"

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.steps_per_round:
            return
        done = self.log.close_round()
        if self.log.clock() > self.cap_s and done < self.rounds:
            self.stopped = "cap"
            control.should_training_stop = True
        elif done >= self.rounds:
            control.should_training_stop = True


def repeat_dataset(source: GroupSource, renderer: ChatRenderer, tokenizer: Any, groups: int) -> Dataset:
    """Rendered prompts of `groups` groups in the dispenser's order, their seeds and task names."""
    texts, seeds, names = [], [], []
    for _ in range(groups):
        task, seed = source.draw()
        env = make_env(task.env, **task.env_kwargs)
        observation, _ = env.reset(seed)
        messages, ids = renderer.first_prompt(task.system_for(env.system_prompt), observation)
        text = renderer.render(messages, generation_prompt=True)
        if tokenizer(text=[text])["input_ids"][0] != ids:  # what TRL does to a plain-text prompt
            raise ValueError(f"TRL would tokenize the prompt of seed {seed} differently from RollArt: {text!r}")
        texts.append(text)
        seeds.append(seed)
        names.append(task.name)
    return Dataset.from_dict({"prompt": texts, "seed": seeds, "task": names})


def trl_config(run: Any, out: Path, rounds: int) -> GRPOConfig:
    """TRL's settings for the topology's trainer and rollout (the report's mapping table says why each)."""
    rollout, spec = run.rollout, run.trainer
    grpo = spec.grpo
    batch = rollout.batch_groups * rollout.group_size
    if batch % spec.updates_per_batch:
        raise SystemExit(f"{batch} completions a round do not split into {spec.updates_per_batch} updates")
    return GRPOConfig(
        output_dir=str(out.with_suffix("")),
        per_device_train_batch_size=batch // spec.updates_per_batch,
        gradient_accumulation_steps=1,
        steps_per_generation=spec.updates_per_batch,  # one optimizer step per mini-batch, as RollArt's
        num_iterations=spec.epochs,  # passes over each generated batch
        num_generations=rollout.group_size,
        max_completion_length=max(t.max_tokens_per_turn for t in rollout.tasks),
        temperature=rollout.sampling.temperature,
        top_p=rollout.sampling.top_p,
        top_k=0,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec.weight_decay,
        adam_beta1=spec.betas[0],
        adam_beta2=spec.betas[1],
        optim="adamw_torch",
        max_grad_norm=spec.grad_clip,
        beta=grpo.kl_coef,
        epsilon=grpo.clip_eps,
        epsilon_high=grpo.clip_high,
        loss_type="dapo",  # token mean over the whole batch
        scale_rewards="group" if grpo.normalize_std else "none",
        max_steps=rounds * spec.epochs * spec.updates_per_batch,
        shuffle_dataset=False,  # groups in the dispenser's order
        bf16=False,
        gradient_checkpointing=False,
        seed=rollout.seed,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


def env_reward_function(tasks: list[TaskSpec], log: RoundLog) -> Any:
    """A TRL reward function: each reply stepped in its env (reset with the row's seed) and scored."""
    by_name = {t.name: t for t in tasks}

    def reward(prompts: list[str], completions: list[str], seed: list[int], task: list[str], **kw: Any) -> list[float]:
        rewards = []
        for prompt, reply, s, name, ids in zip(prompts, completions, seed, task, kw["completion_ids"], strict=True):
            t = by_name[name]
            env = make_env(t.env, **t.env_kwargs)
            env.reset(s)
            _, env_reward, _, _, info = env.step(reply)
            r, ok = score(t, prompt, [reply], info, env_reward=env_reward, tokens=len(ids))
            log.add(name, r, ok)
            rewards.append(r)
        return rewards

    return reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--topology", type=Path, required=True, help="the topology the RollArt side trains")
    parser.add_argument("--out", type=Path, required=True, help="the rounds' JSON lines")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--minutes", type=float, default=20.0, help="stop after this long since the first generation")
    parser.add_argument("--all-groups", action="store_true", help="no dynamic sampling, even where the topology asks")
    args = parser.parse_args()

    run = load_topology(args.topology).run
    rollout, spec = run.rollout, run.trainer
    if rollout is None:
        raise SystemExit(f"{args.topology}: no run.rollout to train")
    import_env_modules(run.env_modules)
    for module in run.reward_modules:
        importlib.import_module(module)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = RoundLog(args.out)
    tokenizer = AutoTokenizer.from_pretrained(run.model.path)
    tokenizer.padding_side = "left"
    renderer = ChatRenderer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(run.model.path, dtype=torch.float32)
    model.generation_config.eos_token_id = renderer.stop_ids  # RollArt stops at each of them
    source = GroupSource(rollout)
    config = trl_config(run, args.out, args.rounds)
    single = len(rollout.tasks) == 1 and Episode.start(rollout.tasks[0], 0, renderer).max_turns == 1
    trainer: ClockedGRPOTrainer
    if single:
        dataset = repeat_dataset(source, renderer, tokenizer, args.rounds * rollout.batch_groups)
        reward = env_reward_function(rollout.tasks, log)
        trainer = ClockedGRPOTrainer(
            model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer
        )
    else:
        placeholder = Dataset.from_dict({"prompt": [""] * config.per_device_train_batch_size})  # not read
        trainer = EpisodeGRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),  # not called: rewards are the envs'
            args=config,
            train_dataset=placeholder,
            processing_class=tokenizer,
        )
        trainer.source, trainer.rollout, trainer.renderer = source, rollout, renderer
        trainer.train_all_groups = args.all_groups
    trainer.round_log = log
    rounds = Rounds(log, spec.epochs * spec.updates_per_batch, args.rounds, args.minutes * 60)
    trainer.add_callback(rounds)
    log.write({"event": "ready", "wall": time.time(), "path": "stock" if single else "episodes"})
    trainer.train()
    log.write({"event": "done", "wall": time.time(), "rounds": log.rounds, "stopped": rounds.stopped})


if __name__ == "__main__":
    main()
