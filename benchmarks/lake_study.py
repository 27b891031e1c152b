"""Seeded study of the default mix's learning, in one process: which runs break out on the lake.

    .venv/bin/python benchmarks/lake_study.py --seeds 0 1 2 3 --steps 100 [--set trainer.grpo.anchor_coef=0 ...]

The default run (`configs/local.yaml`) sometimes sits at a lake success of 0.1-0.2 for all its
steps and sometimes breaks out to 1.0 (docs/training.md). A real run takes 4-6 minutes and its
asynchronous timing makes every run different, seed or not. This study trains the same model on the
same tasks, batch shape and loss with the trainer's own code (`TorchTrainer.train_step`,
`group_advantages`, `select_groups`, `pack_batch`, the env classes, the chat renderer), but
generates in the trainer's process with its current weights (synchronous, on-policy: what RollArt
does with `alpha: 0`), so a seed fixes the whole run and a setting can be compared over many seeds
in minutes. What it leaves out is the asynchronous part: staleness, the order groups finish in.

Per step: groups are drawn by task weight in waves of `batch_groups`; with dynamic sampling, waves
continue until `batch_groups` groups have signal, the surplus waits for the next step (as the
SampleBuffer keeps it), and the uniform groups go along for the anchor. Each run prints one JSON
line: the step at which the lake's 20-step success average first reached 0.8 (null: never), its
average over the last 20 steps, and repeat's. `--threads 1` lets two runs share the 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from rollart.algorithms.grpo import group_advantages, pack_batch
from rollart.algorithms.selection import select_groups
from rollart.envs import make_env
from rollart.rollout.config import TaskSpec
from rollart.rollout.render import ChatRenderer
from rollart.topology import load_topology
from rollart.training.spec import TrainerSpec
from rollart.training.torch.engine import TorchTrainer

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 20


@dataclass
class Episode:
    """One trajectory as `pack_batch` reads it, built turn by turn."""

    task: TaskSpec
    env: Any
    prompt_ids: list[int]
    current: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    done: bool = False


class Sampler:
    """Samples one token per prompt at temperature 1 from the full vocabulary, with its log-prob.
    A prompt's distribution is computed once per version (the lake has 11 boards to be on, `repeat`
    4 letters to start from): each row still samples its own token."""

    def __init__(self, lm: Any, pad: int) -> None:
        self.lm, self.pad = lm, pad
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def new_version(self) -> None:
        self.cache.clear()

    def __call__(self, prompts: list[list[int]]) -> tuple[list[int], list[float]]:
        missing = list(dict.fromkeys(key for p in prompts if (key := tuple(p)) not in self.cache))
        if missing:
            width = max(len(p) for p in missing)
            ids = torch.full((len(missing), width), self.pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(missing):
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            with torch.no_grad():
                logits = self.lm(input_ids=ids, attention_mask=mask).logits
            last = logits[torch.arange(len(missing)), mask.sum(dim=1) - 1].float()
            for p, row in zip(missing, torch.log_softmax(last, dim=-1), strict=True):
                self.cache[p] = row
        logp = torch.stack([self.cache[tuple(p)] for p in prompts])
        tokens = torch.multinomial(logp.exp(), 1).squeeze(1)
        return tokens.tolist(), logp.gather(1, tokens[:, None]).squeeze(1).tolist()


def play(sample: Sampler, renderer: ChatRenderer, episodes: list[Episode], version: int) -> None:
    """Play `episodes` to their end, every active one's next token in one forward pass."""
    stop = set(renderer.stop_ids)
    while active := [e for e in episodes if not e.done]:
        # A turn's reply: up to max_tokens_per_turn tokens, ending early at a stop token.
        replies: dict[int, list[int]] = {id(e): [] for e in active}
        open_ = list(active)
        while open_:
            tokens, logps = sample([e.current + replies[id(e)] for e in open_])
            still = []
            for e, token, logp in zip(open_, tokens, logps, strict=True):
                replies[id(e)].append(token)
                e.response_ids.append(token)
                e.response_mask.append(1)
                e.logprobs.append(logp)
                e.versions.append(version)
                if token not in stop and len(replies[id(e)]) < e.task.max_tokens_per_turn:
                    still.append(e)
            open_ = still
        for e in active:
            reply = renderer.decode(replies[id(e)])
            observation, reward, terminated, truncated, info = e.env.step(reply)
            e.reward += reward
            e.turns += 1
            if terminated or truncated or e.turns >= (e.task.max_turns or e.env.max_turns):
                e.done, e.success = True, bool(info.get("success", False))
                continue
            if e.task.context != "last":
                raise ValueError(f"task {e.task.name!r}: the study plays multi-turn tasks with `context: last` only")
            _, e.current = renderer.first_prompt(e.task.system_for(e.env.system_prompt), observation)
            e.segments.append(len(e.response_ids))
            e.response_ids += e.current
            e.response_mask += [0] * len(e.current)
            e.logprobs += [0.0] * len(e.current)
            e.versions += [-1] * len(e.current)


def new_group(task: TaskSpec, renderer: ChatRenderer, rng: random.Random, size: int) -> list[Episode]:
    seed = rng.randrange(2**31)
    group = []
    for _ in range(size):
        env = make_env(task.env, **task.env_kwargs)
        observation, _ = env.reset(seed)
        _, ids = renderer.first_prompt(task.system_for(env.system_prompt), observation)
        group.append(Episode(task, env, ids, ids))
    return group


def settings(topology: Path, overrides: dict[str, Any]) -> tuple[Any, TrainerSpec, dict[str, Any]]:
    """The topology, its trainer settings and its rollout section (as plain data), `overrides`
    (`trainer.lr`, `rollout.batch_groups`, ...) applied."""
    topo = load_topology(topology)
    if topo.run.rollout is None:
        sys.exit(f"{topology}: no rollout section")
    raw = {"trainer": msgspec.to_builtins(topo.run.trainer), "rollout": msgspec.to_builtins(topo.run.rollout)}
    for key, value in overrides.items():
        section, *path = key.split(".")
        target = raw[section]
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    return topo, msgspec.convert(raw["trainer"], TrainerSpec), raw["rollout"]


@dataclass
class Study:
    """One seeded run: the trainer, the player of the episodes and what the lake's curve did."""

    trainer: TorchTrainer
    rollout: dict[str, Any]
    seed: int
    lag: int
    tasks: list[TaskSpec] = field(init=False)
    renderer: ChatRenderer = field(init=False)
    player: Any = field(init=False)
    sample: Sampler = field(init=False)
    rng: random.Random = field(init=False)
    behind: deque[dict[str, torch.Tensor]] = field(init=False)
    surplus: list[list[Episode]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tasks = [msgspec.convert(t, TaskSpec) for t in self.rollout["tasks"]]
        self.renderer = ChatRenderer(self.trainer.tokenizer)  # type: ignore[arg-type]
        # With `lag` the episodes are played by the weights of `lag` versions back (a copy of the
        # model), as a generator that is behind plays them: the loss then sees stale behaviour log-probs.
        self.player = copy.deepcopy(self.trainer.lm) if self.lag else self.trainer.lm
        self.behind = deque(maxlen=self.lag + 1)
        self.sample = Sampler(self.player, self.trainer.pad_id)
        self.rng = random.Random(self.seed)
        torch.manual_seed(self.seed)

    def batch(self, version: int) -> list[list[Episode]]:
        """Waves of `batch_groups` groups until that many have signal (with dynamic sampling); the
        surplus waits for the next batch, the uniform groups go along."""
        size, wanted = self.rollout["group_size"], self.rollout["batch_groups"]
        dynamic = self.rollout["dynamic_sampling"]
        signal, quiet = list(self.surplus), []
        weights = [t.weight for t in self.tasks]
        while len(signal) < wanted:
            wave = [
                new_group(self.rng.choices(self.tasks, weights)[0], self.renderer, self.rng, size)
                for _ in range(wanted)
            ]
            self.player.eval()
            play(self.sample, self.renderer, [e for g in wave for e in g], max(version - self.lag, 0))
            for g in wave:
                (signal if len({e.reward for e in g}) > 1 or not dynamic else quiet).append(g)
            if not dynamic:
                break
        self.surplus = signal[wanted:]
        return signal[:wanted] + quiet

    def train(self, batch: list[list[Episode]], version: int) -> None:
        cfg = self.trainer.spec.grpo
        rewards = [[e.reward for e in g] for g in batch]
        chosen = select_groups(rewards, anchors=cfg.anchor_groups if cfg.anchor_coef > 0 else 0, rng=self.rng)
        if not chosen.trained:
            return
        advantages = group_advantages(torch.tensor(rewards), normalize_std=cfg.normalize_std, eps=cfg.adv_eps)
        episodes = [e for i in chosen.trained for e in batch[i]]
        packed = pack_batch(episodes, advantages[chosen.trained].flatten().tolist(), pad_id=self.trainer.pad_id)
        self.trainer.lm.train()
        self.trainer.train_step(packed, version=version)
        if self.lag:
            self.behind.append({k: v.detach().clone() for k, v in self.trainer.lm.state_dict().items()})
            self.player.load_state_dict(self.behind[0])
        self.sample.new_version()


def run(
    seed: int, *, steps: int, topology: Path, overrides: dict[str, Any], model: Path | None, lag: int
) -> dict[str, Any]:
    """One seeded run of `steps` steps; returns its JSON line."""
    topo, spec, rollout = settings(topology, overrides)
    study = Study(TorchTrainer(model or ROOT / topo.run.model.path, spec, seed=seed), rollout, seed, lag)
    recent: dict[str, deque[float]] = {t.name: deque(maxlen=WINDOW) for t in study.tasks}
    history: dict[str, list[float]] = {t.name: [] for t in study.tasks}
    solved_at = None
    started = time.monotonic()
    for step in range(1, steps + 1):
        batch = study.batch(step - 1)
        for name, window in recent.items():
            mine = [e.success for g in batch for e in g if e.task.name == name]
            if mine:
                window.append(sum(mine) / len(mine))
            history[name].append(sum(window) / max(len(window), 1))
        lake = history["lake"][-1]
        if solved_at is None and lake >= 0.8 and len(recent["lake"]) == WINDOW:
            solved_at = step
        study.train(batch, step - 1)
        if step % 10 == 0:
            print(f"seed {seed} step {step}: lake {lake:.2f}", file=sys.stderr, flush=True)
    return {
        "seed": seed,
        "overrides": overrides,
        "model": str(model) if model else None,
        "lag": lag,
        "steps": steps,
        "lake_08_at": solved_at,
        "lake_last20": round(history["lake"][-1], 3),
        "repeat_last20": round(history.get("repeat", [0.0])[-1], 3),
        "lake_ma_every10": [round(history["lake"][i], 2) for i in range(9, steps, 10)],
        "seconds": round(time.monotonic() - started, 1),
    }


def report(files: list[str], by: int) -> str:
    """A markdown table of the runs in `files` (this script's JSON lines; `FILE=MODEL` names the
    model those runs started from), one row per setting."""
    settings: dict[str, list[dict[str, Any]]] = {}
    for item in files:
        path, _, label = item.partition("=")
        for line in Path(path).read_text().splitlines():
            result = json.loads(line)
            name = " ".join(f"{k}={json.dumps(v)}" for k, v in result["overrides"].items()) or "as configured"
            model = label or (Path(result["model"]).name if result.get("model") else "")
            name += f" (model: {model})" if model else ""
            name += f", played {result['lag']} versions behind" if result.get("lag") else ""
            settings.setdefault(name, []).append(result)
    lines = [
        f"| setting | runs | seeds | past 0.8 by step {by} | steps to 0.8 (each run) | steps run "
        "| lake last 20 | repeat exact last 20 |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for name, runs in settings.items():
        runs.sort(key=lambda r: r["seed"])
        reached = [r["lake_08_at"] for r in runs]
        passed = sum(1 for at in reached if at is not None and at <= by)
        each = ", ".join("-" if at is None or at > by else str(at) for at in reached)
        lake = sum(r["lake_last20"] for r in runs) / len(runs)
        repeat = sum(r["repeat_last20"] for r in runs) / len(runs)
        seeds = ",".join(str(r["seed"]) for r in runs)
        steps = "/".join(sorted({str(r["steps"]) for r in runs}))
        lines.append(
            f"| {name} | {len(runs)} | {seeds} | {passed}/{len(runs)} | {each} | {steps} | {lake:.2f} | {repeat:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--report", nargs="+", metavar="FILE[=MODEL]", help="print the table of these runs' JSON lines, run nothing"
    )
    parser.add_argument("--by", type=int, default=80, help="the report's step limit for 'past 0.8'")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--topology", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="e.g. trainer.lr=0.002")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", type=Path, help="another model folder (default: the topology's)")
    parser.add_argument("--lag", type=int, default=0, help="play episodes with the weights of this many versions back")
    args = parser.parse_args()
    if args.report:
        print(report(args.report, args.by))
        return
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        result = run(
            seed, steps=args.steps, topology=args.topology, overrides=overrides, model=args.model, lag=args.lag
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
