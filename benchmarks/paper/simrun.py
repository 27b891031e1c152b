"""Shared by the paper experiments: write a simulation-mode topology, run it with real node
processes (`rollart run`) or in-process on a virtual clock (`rollart.launch.inprocess`), and read back
what happened in simulated seconds.

Every experiment runs the real trainer (dispenser, SampleBuffer, alpha), env-hosts (trajectory
coroutines or batch-level stepping, LLMProxy routing) and reward gateway, with `sim` generators
and `sim` environments (docs/simulation.md). Times in the run's logs are real seconds; they are
multiplied by the speedup to give simulated seconds.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rollart.testkit.topology import TopologyBuilder

if TYPE_CHECKING:
    from rollart.launch.inprocess import InProcessRun
    from rollart.topology import Topology

ROOT = Path(__file__).resolve().parents[2]

from rollart.rundir import RunDir  # noqa: E402


@dataclass
class EngineWork:
    """What one generator's simulated engines did over a run, in replica-seconds and tokens."""

    prefill_s: float
    decode_s: float
    prefill_tokens: int
    decode_tokens: int
    replica_cost_per_hour: float
    """Of one replica (its GPUs)."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (`run.sim.prefix_cache`), not prefilled."""

    def cost_per_token(self) -> tuple[float, float]:
        """Prefill and decode cost per token, in cost-units x seconds (one replica's hourly cost times the
        replica-seconds a token took), from what these engines did: NaN where they did none of it."""
        price = self.replica_cost_per_hour
        prefill = price * self.prefill_s / self.prefill_tokens if self.prefill_tokens else float("nan")
        decode = price * self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")
        return prefill, decode


@dataclass
class Result:
    """One run, in simulated seconds."""

    step_s: list[float]
    """Time between consecutive batches handed to the trainer (the first batch left out: start-up)."""
    trajectories: list[dict[str, Any]]
    """Every trajectory of the batches taken (rollout.jsonl)."""
    versions: list[int]
    """The policy version (batch index) each trajectory was taken at."""
    speedup: float
    aborted_stale: int = 0
    """Trajectories the env-hosts aborted, while running, because a new version made them too stale."""
    dropped_stale: int = 0
    """Groups that finished but went stale in the trainer's buffer before a batch took them (dropped
    and run again): the other half of the work staleness costs. Which half a stale group lands in
    depends only on whether it finished before the version that made it stale."""
    generator_busy: dict[str, float] | None = None
    """In-process runs: each generator's busy fraction."""
    reward_utilization: float | None = None
    """In-process runs with a simulated reward: busy / live reward worker-seconds."""
    cpu_s: float | None = None
    """In-process runs: CPU seconds the whole simulation took."""
    started: int | None = None
    """In-process runs: trajectories the env-hosts started (batched, aborted, or cut off at the end)."""
    turns: int | None = None
    """In-process runs: generation calls the env-hosts' proxies had served (turns of every trajectory
    started, finished or not)."""
    batch_tokens: dict[int, int] | None = None
    """In-process runs: prompt and response tokens of each batch, by version."""
    batched: int | None = None
    """In-process runs: trajectories in the batches taken."""
    weights_pushed: list[int] | None = None
    """In-process runs with a simulated trainer: the versions it pushed, in order (an asynchronous
    push skips a version made while the trainer's link was still busy, when a newer one follows)."""
    engine_work: dict[str, EngineWork] | None = None
    """In-process runs: what each generator's simulated engines did over the whole run."""

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)


def tiny_tokenizer_model() -> Path:
    """The tiny model whose tokenizer renders prompts (its weights are never used in simulation)."""
    from rollart.tiny.model import ensure_tiny_model

    return ensure_tiny_model(ROOT / ".cache" / "models" / "tiny-qwen3", seed=0)


def run(
    run_spec: dict[str, Any],
    nodes: list[dict[str, Any]],
    *,
    timeout_s: float = 1800,
    keep: Path | None = None,
    inprocess: bool = False,
    keep_groups: bool = True,
) -> Result:
    """Run a topology whose `run` section is `run_spec` and whose nodes are `nodes` (ports are added);
    the run directory goes to `keep` when given, else it is deleted. `inprocess`: every node in this
    process on a virtual clock (run_spec's `sim.speedup` must be 1)."""
    if inprocess:
        return run_inprocess_spec(run_spec, nodes, keep_groups=keep_groups)
    with tempfile.TemporaryDirectory(prefix="rollart-paper-") as tmp:
        folder = keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        builder = TopologyBuilder(folder / "run", name="paper", drain_timeout_s=5).run_section(**run_spec)
        for node in nodes:
            builder.node(**node)
        path = builder.write(folder / "topology.yaml")
        env = {k: v for k, v in os.environ.items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
        result = subprocess.run(
            [sys.executable, "-m", "rollart.cli", "run", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        run_dir = RunDir(folder / "run")
        if result.returncode != 0:
            raise SystemExit(f"run failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        speedup = float(run_spec.get("sim", {}).get("speedup", 1.0))
        taken = [
            datetime.datetime.fromisoformat(event["timestamp"]).timestamp()
            for event in events(run_dir.node_log("trainer"), "trainer.batch")
        ]
        steps = [(b - a) * speedup for a, b in itertools.pairwise(taken)]
        lines = run_dir.rollout.read_text().splitlines()
        records = [json.loads(line) for line in lines]
        trajectories = [t for r in records for t in r["group"]["trajectories"]]
        versions = [r["version"] for r in records for _ in r["group"]["trajectories"]]
        aborted = 0
        for log in run_dir.logs.glob("*.log"):
            for summary in events(log, "env_host.summary")[-1:]:
                aborted += summary.get("aborted_stale", 0)
        (trainer,) = events(run_dir.node_log("trainer"), "trainer.summary")[-1:]
        return Result(steps, trajectories, versions, speedup, aborted, trainer["buffer"]["dropped_stale"])


def add_mode_arguments(parser: argparse.ArgumentParser, *, speedup: float, out: Path) -> None:
    """`--speedup` (multi-process runs), `--inprocess` and `--out` (default `out`, or its
    `-inprocess` sibling); call `resolve_mode(args)` after parsing."""
    parser.add_argument(
        "--speedup", type=float, default=speedup, help="multi-process runs: a host that falls behind stretches time"
    )
    parser.add_argument("--inprocess", action="store_true", help="every node in this process, on a virtual clock")
    parser.add_argument("--out", type=Path, default=None, help=f"the result file (default {out.name})")
    parser.set_defaults(default_out=out)


def resolve_mode(args: argparse.Namespace) -> None:
    """In-process runs have speedup 1 and write beside the multi-process result, not over it."""
    if args.inprocess:
        args.speedup = 1.0
    if args.out is None:
        out = args.default_out
        args.out = out.with_name(f"{out.stem}-inprocess{out.suffix}") if args.inprocess else out


def mode_words(args: argparse.Namespace) -> str:
    return "in-process, virtual clock" if args.inprocess else f"real node processes, speedup {args.speedup:g}"


def run_inprocess_spec(run_spec: dict[str, Any], nodes: list[dict[str, Any]], *, keep_groups: bool = True) -> Result:
    """`run` in-process: the same nodes over an in-memory network, on a virtual-time loop.
    `keep_groups=False` (large shapes): `trajectories` stays empty and `batch_tokens` has the counts."""
    from rollart.launch.inprocess import run_inprocess

    with tempfile.TemporaryDirectory(prefix="rollart-paper-") as tmp:
        done = run_inprocess(
            inprocess_topology(run_spec, nodes, Path(tmp)), log=Path(tmp) / "nodes.log", keep_groups=keep_groups
        )
    return inprocess_result(done)


def inprocess_topology(
    run_spec: dict[str, Any], nodes: list[dict[str, Any]], folder: Path, *, name: str = "paper", first_port: int = 20000
) -> Topology:
    """The topology of `run_spec` and `nodes` for an in-process run, its ports from `first_port` on
    (addresses only: nothing listens on them), its run directory in `folder`."""
    from rollart.topology import parse_topology

    placed = [node | {"port": first_port + 2 * i, "admin_port": first_port + 1 + 2 * i} for i, node in enumerate(nodes)]
    spec = {"run": {"name": name, "run_dir": str(folder / name), "drain_timeout_s": 5} | run_spec, "nodes": placed}
    return parse_topology(yaml.safe_dump(spec, sort_keys=False))


def inprocess_result(done: InProcessRun) -> Result:
    """What the figures read of an in-process run."""
    from rollart.generation.sim import SimEngine
    from rollart.nodes import EnvHostNode, GeneratorNode, TrainerNode
    from rollart.nodes.trainer_rollout_only import SimulatedStep, as_record

    trajectories, versions = [], []
    for batch in done.batches:
        for group in batch.groups:
            trajectories += [as_record(t) for t in group.trajectories]
            versions += [batch.version] * len(group.trajectories)
    env_hosts = [node for node in done.nodes.values() if isinstance(node, EnvHostNode)]
    aborted = sum(node.rollout_state.counts["aborted_stale"] for node in env_hosts)
    dropped = sum(node.buffer.dropped_stale for node in done.nodes.values() if isinstance(node, TrainerNode))
    started = sum(node.rollout_state.counts["envs_opened"] for node in env_hosts)
    reward = done.reward.utilization if done.reward is not None and done.reward.cold_starts.count else None
    result = Result(
        done.step_s, trajectories, versions, 1.0, aborted, dropped, done.generator_busy, reward, done.cpu_s, started
    )
    result.batch_tokens = {batch.version: batch.tokens for batch in done.batches}
    result.turns = sum(sum(g.calls.values()) for node in env_hosts for g in node.rollout_state.proxy.generators)
    result.batched = done.trajectories
    for node in done.nodes.values():
        if isinstance(node, TrainerNode) and isinstance(node.steps, SimulatedStep):
            result.weights_pushed = list(node.steps.pushed)
    result.engine_work = {
        name: EngineWork(
            sum(e.prefill_s for e in engines),
            sum(max(0.0, e.busy_s - e.prefill_s) for e in engines),  # a prefill-only engine: 0, not -0
            sum(e.prefilled_tokens for e in engines),
            sum(e.generated_tokens for e in engines),
            engines[0].cost.cost_per_hour / engines[0].cost.shape.replicas,
            sum(e.cached_tokens for e in engines),
        )
        for name, node in done.nodes.items()
        if isinstance(node, GeneratorNode) and node.engine is not None
        if (engines := [e for e in node.engine.engines if isinstance(e, SimEngine)])
    }
    return result


def _provenance(began: float, shape: str) -> str:
    """The date, machine, command, code and shape lines every result (or section of one) starts with."""
    command = " ".join(["python", str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]])
    return (
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: nproc {os.cpu_count()}, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}\n"
        f"- command: `{command}` (from the repository root; took {time.monotonic() - began:.0f} s)\n"
        f"- code: {CODE}\n"
        f"- shape: {shape}\n\n"
    )


def write_report(out: Path, title: str, *, began: float, shape: str, body: str) -> None:
    """Write a result file: the title, date, machine, the command that made it, the shape, then `body`."""
    report = f"# {title}\n\n{_provenance(began, shape)}{body}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"wrote {out}")


def write_section(out: Path, title: str, heading: str, *, began: float, shape: str, body: str) -> None:
    """Write one `## heading` section of a result file that several experiments share: the same
    lines as `write_report`, under the heading; the file's other sections stay as they are."""
    section = f"## {heading}\n\n{_provenance(began, shape)}{body}\n"
    parts = re.split(r"(?m)^(?=## )", out.read_text()) if out.exists() else [f"# {title}\n\n"]
    sections = parts[1:]
    same = [i for i, part in enumerate(sections) if part.splitlines()[0] == f"## {heading}"]
    if same:
        sections[same[0]] = section  # where it was: a re-run does not reorder the file
    else:
        sections.append(section)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(parts[0] + "\n".join(part.rstrip("\n") + "\n" for part in sections))
    print(f"wrote {heading!r} in {out}")


def save_plot(
    out: Path, title: str, ylabel: str, bars: dict[str, float], paper: dict[str, float] | None = None
) -> None:
    """A bar chart beside the result file (`out` with .png): ours per configuration, and the
    paper's number where it gives one (hatched)."""
    from matplotlib.figure import Figure

    labels = list(bars)
    figure = Figure(figsize=(max(6.0, 1.6 * len(labels)), 4.0), layout="constrained")
    ax = figure.add_subplot()
    width = 0.38 if paper else 0.6
    xs = range(len(labels))
    ax.bar([x - (width / 2 if paper else 0) for x in xs], [bars[k] for k in labels], width, label="RollArt (simulated)")
    if paper:
        known = [(x, paper[k]) for x, k in zip(xs, labels, strict=True) if k in paper]
        ax.bar([x + width / 2 for x, _ in known], [v for _, v in known], width, hatch="//", fill=False, label="paper")
        ax.legend()
    ax.set_xticks(list(xs), [label.replace(" (", "\n(") for label in labels], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    path = out.with_suffix(".png")
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def code_version() -> str:
    """The commit the working tree is at, and whether it had changes (other than to results, which
    the experiments write as they go)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return f"commit {git('rev-parse', '--short', 'HEAD') or 'unknown'}" + (" with uncommitted changes" if dirty else "")


CODE = code_version()
"""The code an experiment runs: read when it starts (an edit made while it runs does not count)."""


def events(log: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            found.append(json.loads(line))
    return found


# The paper's shape (Fig. 10): Qwen3-32B, batch 512 (64 groups of 8), tasks drawn uniformly: a
# FrozenLake-like game (multi-turn, long observations: prefill-heavy) and a math-like task (one
# long answer: decode-heavy); 96 H800 (32 training, 64 serving as 8 engines of 8) and 32 H20
# (4 engines of 8); the weights cross to the generators over 200 Gb/s Ethernet.
GAME_OBS_TOKENS = 600
GAME_ANSWER_TOKENS = 64
GAME_MAX_TOKENS = 16384
"""The game's tokens: each observation, each answer, and a whole trajectory at most."""

PAPER_NODES = [
    {"name": "trainer", "role": "trainer"},
    {"name": "gen-h800", "role": "generator", "hardware": "compute"},
    {"name": "gen-h20", "role": "generator", "hardware": "bandwidth"},
    {"name": "env-0", "role": "env-host"},
    {"name": "env-1", "role": "env-host"},
    {"name": "reward", "role": "reward-gateway"},
]


PAPER_ENGINES = {
    "compute": {"gpu": "H800", "gpus": 8, "replicas": 8},
    "bandwidth": {"gpu": "H20", "gpus": 8, "replicas": 4},
}
"""64 H800 as 8 engines of 8 (TP 8), 32 H20 as 4 engines of 8."""


def paper_run_spec(
    model: Path,
    *,
    speedup: float,
    steps: int,
    sigma: float = 1.0,
    engines: dict[str, Any] | None = None,
    reward: dict[str, Any] | None = None,
    **rollout: Any,
) -> dict[str, Any]:
    """The `run` section of the paper's shape; `engines` replaces its generators' shapes, `reward` its
    simulated reward (default: rule-based, instant), `rollout` overrides rollout keys (schedule, alpha, ...)."""
    return {
        "restart": {"policy": "stop-all"},
        "model": {"path": str(model)},
        "generator": {"backend": "sim", "max_num_seqs": 256},
        "reward_pool": {"min_workers": 2, "max_workers": 2},
        "sim": {
            "speedup": speedup,
            "model": "qwen3-32b",
            "engines": engines or PAPER_ENGINES,
            "response_length_min_frac": 0.25,
            "max_steps_per_wake": 32,
            "trainer": {"gpu": "H800", "gpus": 32, "mfu": 0.4, "link_gbps": 200.0},
            "reward": reward or {"placement": "instant"},
        },
        "rollout": {
            "mode": "rollout-only",
            "tasks": [
                {
                    "name": "game",
                    "env": "sim",
                    "env_kwargs": {
                        "turns": [3, 10],
                        "obs_tokens": GAME_OBS_TOKENS,
                        "reset_s": 8.0,
                        "step_s": 1.0,
                        "sigma": sigma,
                    },
                    "profile": "prefill-heavy",
                    "max_tokens_per_turn": GAME_ANSWER_TOKENS,
                    "max_total_tokens": GAME_MAX_TOKENS,
                },
                {
                    "name": "math",
                    "env": "sim",
                    "env_kwargs": {"turns": 1, "obs_tokens": 400, "reset_s": 1.0, "sigma": sigma},
                    "profile": "decode-heavy",
                    "max_tokens_per_turn": 8192,
                    "max_total_tokens": 16384,
                },
            ],
            "group_size": 8,
            "redundancy": 0,
            "batch_groups": 64,
            "steps": steps,
            "groups_per_env_host": 96,
            "generate_timeout_s": 600,
            "env_timeout_s": 600,
            "group_timeout_s": 3600,
        }
        | rollout,
    }


def task_share(result: Result, task: str) -> float:
    """The fraction of the batches' trajectories that are of `task`: what the trainer saw of the mix (a
    schedule that trains whatever finishes first could tilt it toward quick tasks)."""
    return sum(t["task"] == task for t in result.trajectories) / max(1, len(result.trajectories))


def train_step_s(result: Result, gpus: int = 32, model: str = "qwen3-32b") -> float:
    """The simulated trainer's mean step on these batches (the paper shape's 32 H800, mfu 0.4)."""
    from rollart.sim.hardware import GPUS, MODELS
    from rollart.sim.hardware import train_step_s as step_s

    tokens: dict[int, int] = dict(result.batch_tokens or {})
    if not tokens:
        for t, version in zip(result.trajectories, result.versions, strict=True):
            tokens[version] = tokens.get(version, 0) + len(t["prompt_ids"]) + len(t["response_ids"])
    shape, gpu = MODELS[model], GPUS["H800"]
    return sum(step_s(shape, gpu, gpus=gpus, mfu=0.4, tokens=n) for n in tokens.values()) / len(tokens)
