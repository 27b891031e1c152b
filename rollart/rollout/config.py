"""Typed settings of rollout: tasks and their mix, groups, redundancy, alpha, the model to use.

Part of the topology's `run` section (`run.model`, `run.rollout`, `run.env_modules`); checked where the
topology is loaded. Imports no torch. `run.generator` is `rollart.generation.config`, `run.reward_pool`
`rollart.rewards.config`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rollart.envexec.config import EnvWorkersSpec

Profile = Literal["prefill-heavy", "decode-heavy"]
Routing = Literal["finish-time", "class", "disaggregated"]

_STRUCT = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}


class ModelSpec(msgspec.Struct, **_STRUCT):
    """The policy model: any Hugging Face model folder, or the tiny model built on first use."""

    path: str = "runs/models/tiny-qwen3"
    """Model folder (config.json, safetensors, tokenizer); relative to the working directory."""
    build_tiny_if_missing: bool = True
    """Build the tiny default model at `path` when the folder has no model yet."""
    seed: int = 0
    """Seed of the tiny model's initial weights."""
    format_warmup_steps: int = 0
    """After building the tiny model: supervised steps on random *valid* actions of the run's tasks
    (the reply format only, never a solution; `rollart.tiny.warmup`); 0: none."""
    shape: str | None = None
    """A preset of `rollart.models.presets` (`qwen3-8b`, ...) that `rollart check` sizes the nodes for while
    `path` has no config.json yet; a checkpoint's own config.json wins when there is one. None: only that."""


AGENT_ENV = "agent"
"""The `env` of a task whose episodes an agent program plays (`TaskSpec.agent`)."""


class AgentProgram(msgspec.Struct, **_STRUCT):
    """An agent program that plays a task's episodes through an OpenAI-compatible endpoint (`env: agent`):
    started once per episode, in the env workers' sandbox, with `OPENAI_BASE_URL` and `OPENAI_API_KEY` set
    to its episode's endpoint (docs/agents.md)."""

    command: list[str]
    """The program and its arguments; `{python}` stands for the env-host's Python interpreter."""
    cwd: str | None = None
    """Its working directory, relative to the env-host's (None: the env-host's); inside a sandbox it is read-only,
    and the program writes in its scratch directory (`$TMPDIR`)."""
    env: dict[str, str] = {}
    """More environment variables for it (the node's secrets are never passed)."""
    reward: Literal["report", "gateway"] = "report"
    """report: the program's own report (`POST <base_url>/rollart/report` with `{"reward": ...}`); an episode
    that ends without one fails. gateway: the task's `reward` function scores the final transcript."""
    timeout_s: float = 600.0
    """An episode's program still running after this long is stopped and the episode fails."""


class TaskSpec(msgspec.Struct, **_STRUCT):
    """One task of the mix: an environment, how to sample in it, and how to score it."""

    name: str
    """Name in reports and routing statistics."""
    env: str
    """Registered environment name (see docs/envs.md)."""
    env_kwargs: dict[str, Any] = {}
    """Passed to the environment's factory."""
    weight: float = 1.0
    """Share of groups drawn from this task, relative to the others."""
    profile: Profile | None = None
    """Starting guess for routing (None: the environment's own); then measured."""
    reward: str = "env-reward"
    """Reward function run by the reward gateway (see docs/rewards.md)."""
    max_turns: int | None = None
    """Turns before the trajectory is cut (None: the environment's own limit)."""
    max_tokens_per_turn: int = 48
    """Tokens the model may generate in one turn."""
    max_total_tokens: int = 1024
    """Prompt plus response tokens before the trajectory is cut (with `context: last`: of one turn)."""
    system_prompt: str | None = None
    """Replaces the environment's system prompt; "" for none (a tiny model cannot read instructions,
    and every prompt gets shorter). None: the environment's own."""
    context: Literal["full", "template", "last"] = "full"
    """What each turn's prompt holds (`rollart.rollout.render`). full: the whole conversation as it happened,
    the model's earlier replies token for token, thinking included: one sequence per trajectory. template:
    the conversation as the model's chat template renders it (Qwen3's drops earlier turns' thinking), what
    the model will be shown when served with that template; a turn the template rewrote starts a sequence
    of its own. last: the system prompt and the latest observation alone, for environments whose
    observation says everything (FrozenLake's board). The trainer trains each sequence on its own with the
    trajectory's advantage."""
    agent: AgentProgram | None = None
    """With `env: agent`: the program that plays this task's episodes."""
    thinking: bool | None = None
    """Passed to the chat template as `enable_thinking` (Qwen3: false adds an empty `<think></think>` to the
    generation prompt, so the model answers at once); None: the template's default. The environment and
    the reward always get the reply after its thinking."""

    def system_for(self, env_system_prompt: str) -> str:
        """The system prompt of this task's conversations in an environment with `env_system_prompt`."""
        return env_system_prompt if self.system_prompt is None else self.system_prompt

    def chat_options(self) -> dict[str, Any]:
        """Keyword arguments for the model's chat template."""
        return {} if self.thinking is None else {"enable_thinking": self.thinking}


class SamplingSpec(msgspec.Struct, **_STRUCT):
    """How generators sample."""

    temperature: float = 1.0
    """Logits are divided by it before sampling; the trainer's log-probs divide by it too (0: greedy, rollouts
    only)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off); training runs need 1 (`validate`)."""

    def validate(self, *, train: bool) -> list[tuple[str, str]]:
        """(key, problem); `train`: the tokens are trained on, so the trainer must score them under the
        distribution they were sampled from."""
        problems = []
        if self.temperature < 0:
            problems.append(("temperature", f"expected a value >= 0; got {self.temperature}"))
        elif train and self.temperature == 0:
            problems.append(("temperature", "training samples: expected a value > 0 (0 is greedy decoding)"))
        if not 0 < self.top_p <= 1:
            problems.append(("top_p", f"expected a value in (0, 1]; got {self.top_p}"))
        elif train and self.top_p < 1:
            problems.append(
                (
                    "top_p",
                    f"{self.top_p}: the trainer scores tokens over the whole vocabulary at the temperature and does "
                    "not cut it to each position's nucleus as the generator did, which would bias every importance "
                    "weight; set top_p: 1 (lower the temperature instead)",
                )
            )
        return problems


class EvalTaskSpec(msgspec.Struct, **_STRUCT):
    """A held-out twin of a training task: the same task with some env kwargs changed (a dataset's
    `split: heldout`)."""

    of: str
    """The training task it is a twin of."""
    name: str | None = None
    """Its name in the metrics (None: `<of>-heldout`)."""
    env_kwargs: dict[str, Any] = {}
    """Laid over the training task's `env_kwargs`, key by key."""

    def task_name(self) -> str:
        return self.name if self.name is not None else f"{self.of}-heldout"


class EvalSpec(msgspec.Struct, **_STRUCT):
    """Held-out evaluation during a training run (`rollart.rollout.evaluation`): before the first step,
    every `every` steps and after the last, each eval task's first `problems` seeds are run once greedily
    (temperature 0: pass@1) and `k` times sampled as the run samples (pass@k); the figures go to the metrics
    (`{"eval": true, ...}` lines), the trackers (`eval/...`) and the run report. Eval groups are never
    trained on, and they do not count against admission: they come first when an env-host asks for work."""

    every: int = 10
    """Steps between evaluations."""
    problems: int = 32
    """Problems per eval task: seeds `first_seed` .. `first_seed + problems - 1` (the same every round)."""
    first_seed: int = 1_000_000_000
    """The first eval seed. Training draws its seeds upward from `rollout.seed * 1_000_003`, so from 10**9
    on a generated task's eval problems are none it trains on (a dataset's split keeps its rows apart
    whatever the seed: seed i takes row i mod its size)."""
    k: int = 4
    """Sampled tries per problem for pass@k; 0: greedy only."""
    tasks: list[EvalTaskSpec] = []

    def validate(self, train: list[TaskSpec]) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        for key, low in (("every", 1), ("problems", 1), ("k", 0), ("first_seed", 0)):
            if getattr(self, key) < low:
                problems.append((f"eval.{key}", f"expected an integer >= {low}; got {getattr(self, key)}"))
        if not self.tasks:
            problems.append(("eval.tasks", "expected at least one task to evaluate"))
        names = {task.name for task in train}
        seen: set[str] = set()
        for i, task in enumerate(self.tasks):
            if task.of not in names:
                problems.append((f"eval.tasks[{i}].of", f"no training task {task.of!r} (tasks: {sorted(names)})"))
            name = task.task_name()
            if name in names or name in seen:
                problems.append((f"eval.tasks[{i}].name", f"task name {name!r} is taken"))
            seen.add(name)
        return problems


class RolloutSpec(msgspec.Struct, **_STRUCT):
    """Groups, redundancy and the staleness bound."""

    mode: Literal["rollout-only", "train"] = "rollout-only"
    """rollout-only collects groups without training (versions bump per batch if asked)."""
    schedule: Literal["async", "sync"] = "async"
    """async: RollArt, rollout overlaps training within alpha. sync: the veRL-like baseline: generate a
    whole batch with batch-level env stepping, train, push the weights and wait for every generator
    to load them, repeat (the loader sets alpha 0 and env_stepping batch)."""
    tasks: list[TaskSpec] = []
    """The task mix."""
    group_size: int = 4
    """G: trajectories per group (one prompt, G samples)."""
    redundancy: int = 1
    """R: extra trajectories started per group; the first G to finish make the group."""
    min_group_size: int | None = None
    """A group may finish with fewer than G trajectories, at least this many, once it is past its deadline:
    the `deadline_quantile` of its task's trajectory times, learned on each env-host. The slowest of a
    group's G then no longer holds the group (and its slot) up. None: every group waits for its G. The
    bias: the trajectories cut are the slowest, so where time and reward go together (an episode that
    gives up early is quick) the batch leans toward quick episodes; each kept trajectory's advantage is
    taken against its own group's kept ones (`rollart.rollout.group`)."""
    deadline_quantile: float = 0.9
    """Of a task's trajectory times, the one a group's deadline is (with `min_group_size`)."""
    max_redundancy: int | None = None
    """Adaptive redundancy: each env-host gives each group from `redundancy` to this many extras, as many as
    make its task's groups cheapest by the trajectory times it learned: (G + R) trajectories held until the
    G-th of them finishes (`rollart.rollout.group.GroupDeadlines.extras`). A long tail gets extras, a short
    one none. None: always `redundancy`."""
    batch_groups: int = 4
    """Groups per training batch."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: only groups whose rewards differ count toward `batch_groups`; the
    uniform ones (no signal) go out beside the batch, so a solved task leaves the gradient to the
    tasks still learning (see `rollart.rollout.buffer`)."""
    max_uniform_batches: int = 4
    """With dynamic sampling, a batch is handed out anyway once this many batches' worth of groups
    without signal wait (a mix solved everywhere, or nowhere yet, still steps)."""
    alpha: int = 1
    """Staleness bound: at version n, every trajectory used was started at version n - alpha or later."""
    lookahead: Literal["adaptive", "alpha"] = "adaptive"
    """How many batches of work admission lets start beyond the one the trainer waits for. alpha:
    always alpha (AReaL's rule). adaptive: one at the start (alpha batches started at once would all
    share the generators and hold back the first), one more (up to alpha) after each batch the trainer
    had to wait for, one fewer (down to 0) after 3 in a row it found complete when it asked. Such a
    trainer is the slower side: with none ahead the next batch is generated while it trains on this
    one (one version old when trained), and work started further ahead would only be staler, at no
    gain in speed (`rollart.rollout.dispenser`)."""
    steps: int | None = None
    """Batches to collect (or train on) before the run is done; None: until stopped."""
    bump_version_every_batch: bool = True
    """In rollout-only mode, count each batch taken as a new policy version (exercises alpha)."""
    groups_per_env_host: int = 4
    """Groups one env-host runs at once."""
    env_stepping: Literal["trajectory", "batch"] = "trajectory"
    """trajectory: each trajectory moves on its own (RollArt); batch: each env-host runs its groups
    as one batch whose every turn waits for all of them (the synchronous baseline)."""
    sampling: SamplingSpec = SamplingSpec()
    generate_timeout_s: float = 60.0
    """Deadline of one generation call; past it the turn is re-issued on another generator."""
    env_timeout_s: float = 10.0
    """Deadline of one environment call; past it the trajectory fails (and an env worker running it is killed)."""
    env_workers: EnvWorkersSpec = EnvWorkersSpec()
    """Where env code runs, and the limits of env worker processes."""
    reward_timeout_s: float = 30.0
    """Deadline of one scoring call."""
    group_timeout_s: float = 600.0
    """A group not returned by then is re-issued."""
    task_wait_s: float = 5.0
    """How long an idle env-host slot's request for a group waits at the trainer for room (at most
    30 s) before it asks again. Longer: fewer messages from slots beyond the admission limit (at
    thousands of env-hosts they are most of the traffic), but an idle env-host drains that much slower."""
    group_attempts: int = 3
    """Tries of one task and seed: when a try fails and this many were made, the seed is given up
    for a fresh one, so a task instance that breaks its env every time does not hold a slot forever."""
    routing: Routing = "class"
    """How an env-host picks a generator for each turn (`rollart.rollout.routing`): `class`, the paper's: the
    class the task's profile prefers always, least loaded within it, others only when it is down; or
    `finish-time`, where the turn is predicted to finish first (its task's measured service time there,
    plus that generator's backlog) within its preferred class, which it leaves only when that class
    queues or is saturated while another has room (it rescues an undersized class but costs the
    best-sized mix throughput, so it is not the default: docs/topology.md has the measurements);
    `disaggregated`: every turn is prefilled on a compute generator and decoded on a bandwidth one, its KV
    cache handed over (vLLM's disaggregated prefill across GPU kinds), each half routed as `class` routes a
    turn; on a backend that hands KV cache on (`GenerationBackend.kv_handoff`)."""
    profile_ratio: float = 16.0
    """A task whose prompt tokens per generated token exceed this is prefill-heavy. A decode step is
    bandwidth-bound and costs about what prefilling 10-20 tokens does, hence the default."""
    seed: int = 0
    """Seed of the task mix and the environment seeds."""
    eval: EvalSpec | None = None
    """Held-out evaluation every few steps (train mode); None: none."""

    def eval_tasks(self) -> list[TaskSpec]:
        """The eval tasks as tasks: each its training task's settings, renamed, with its env kwargs laid over."""
        if self.eval is None:
            return []
        train = {task.name: task for task in self.tasks}
        return [
            msgspec.structs.replace(
                train[twin.of], name=twin.task_name(), env_kwargs={**train[twin.of].env_kwargs, **twin.env_kwargs}
            )
            for twin in self.eval.tasks
            if twin.of in train
        ]

    def all_tasks(self) -> list[TaskSpec]:
        """The training tasks, then the eval tasks: every task an env-host may be given."""
        return [*self.tasks, *self.eval_tasks()]

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable."""
        problems: list[tuple[str, str]] = []
        lows = (
            ("group_size", 1),
            ("redundancy", 0),
            ("batch_groups", 1),
            ("alpha", 0),
            ("max_uniform_batches", 1),
            ("group_attempts", 1),
        )
        for key, low in lows:
            if getattr(self, key) < low:
                problems.append((key, f"expected an integer >= {low}; got {getattr(self, key)}"))
        if self.min_group_size is not None and not 2 <= self.min_group_size <= self.group_size:
            problem = f"expected an integer from 2 (a group needs two to compare) to group_size ({self.group_size})"
            problems.append(("min_group_size", f"{problem} or null; got {self.min_group_size}"))
        if self.max_redundancy is not None and self.max_redundancy < self.redundancy:
            problems.append(
                ("max_redundancy", f"expected >= redundancy ({self.redundancy}) or null; got {self.max_redundancy}")
            )
        if not 0 < self.deadline_quantile < 1:
            problems.append(("deadline_quantile", f"expected a value in (0, 1); got {self.deadline_quantile}"))
        if self.groups_per_env_host < 1:
            problems.append(("groups_per_env_host", f"expected an integer >= 1; got {self.groups_per_env_host}"))
        if self.steps is not None and self.steps < 1:
            problems.append(("steps", f"expected an integer >= 1 or null; got {self.steps}"))
        for key in ("generate_timeout_s", "env_timeout_s", "reward_timeout_s", "group_timeout_s", "profile_ratio"):
            if getattr(self, key) <= 0:
                problems.append((key, f"expected a value > 0; got {getattr(self, key)}"))
        if not 0 <= self.task_wait_s <= 30:
            problems.append(("task_wait_s", f"expected a value in [0, 30]; got {self.task_wait_s}"))
        if not self.tasks:
            problems.append(("tasks", "expected at least one task"))
        problems += [(f"env_workers.{key}", problem) for key, problem in self.env_workers.validate()]
        seen: set[str] = set()
        for i, task in enumerate(self.tasks):
            if task.name in seen:
                problems.append((f"tasks[{i}].name", f"duplicate task name {task.name!r}"))
            seen.add(task.name)
            if task.weight <= 0:
                problems.append((f"tasks[{i}].weight", f"expected a value > 0; got {task.weight}"))
            if task.max_tokens_per_turn < 1:
                problems.append((f"tasks[{i}].max_tokens_per_turn", f"expected >= 1; got {task.max_tokens_per_turn}"))
            if (task.env == AGENT_ENV) != (task.agent is not None):
                problems.append((f"tasks[{i}].agent", "an agent program goes with `env: agent`, and only with it"))
            elif task.agent is not None and (not task.agent.command or task.agent.timeout_s <= 0):
                problems.append((f"tasks[{i}].agent", "expected a command and a timeout_s > 0"))
        problems += [
            (f"sampling.{key}", problem) for key, problem in self.sampling.validate(train=self.mode == "train")
        ]
        if self.eval is not None:
            problems += self.eval.validate(self.tasks)
            if self.mode != "train":
                problems.append(("eval", "held-out evaluation needs `mode: train` (a policy that changes)"))
        return problems
