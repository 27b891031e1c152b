"""The `rollart` command line.

    rollart run TOPOLOGY [--duration S]   start every node of the topology here, show their status
    rollart simulate TOPOLOGY             run a simulation topology in-process on a virtual clock
    rollart check TOPOLOGY                validate a topology, and size every node against its declared GPUs
    rollart build-model DIR [--seed N] [--preset tiny|qwen3-bpe]
                                          build the tiny default model (Hugging Face format) in DIR, or
                                          qwen3-bpe: a 29 M Qwen3 with a byte-level BPE tokenizer (tests)
    rollart report RUN_DIR [--out DIR]    plots and a summary of a training run (default DIR: RUN_DIR/report)
    rollart export RUN_DIR OUT [--step N | --checkpoint PATH] [--dtype auto|bf16|fp32] [--force] [--adapters]
                                          the trained policy as a Hugging Face model folder (a LoRA
                                          run's: merged, or with --adapters the PEFT adapter folder)
    rollart slurm TOPOLOGY [--out FILE] [--partition ROLE=NAME] [--time LIMIT]
                                          write an sbatch script: a het job, one component per role
    rollart certs DIR --topology FILE [--days N] [--renew]
                                          a CA (unless DIR has one) and a TLS certificate per node (run.tls)
    rollart status|pause|resume|drain --topology FILE [--node NAME]
                                          every node's admin API, as a table (rollart/admin_cli.py)

`run` on a topology whose generators use vLLM (the default backend) sets up `.venv-vllm` with
`bin/setup-vllm` when vLLM is missing here, and runs again there.

Exit codes: 0 success; 1 a node failed (the run says which), or did not answer (admin commands);
2 bad configuration or usage (for `report`: a run directory without metrics.jsonl; for `export`: no
complete checkpoint, or OUT in the way); 3 an admin command was refused (wrong or missing token).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from rollart.errors import ConfigError
from rollart.generation.registry import OwnVenv
from rollart.generation.registry import backend as generation_backend
from rollart.rundir import RunDir
from rollart.topology import Topology, load_topology
from rollart.topology.roles import Role

EXIT_CONFIG = 2
IN_VENV_ENV = "ROLLART_IN_BACKEND_VENV"
"""Set when `run` re-runs itself in a backend's own environment, so it does not set that up again."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollart", description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run every node of a topology on this machine")
    run.add_argument("topology", help="the topology YAML file, e.g. configs/local.yaml")
    run.add_argument("--duration", type=float, default=None, help="stop after this many seconds of running")
    run.add_argument("--start-timeout", type=float, default=120.0, help="seconds for every node to become healthy")
    simulate = commands.add_parser(
        "simulate", help="run a simulation topology in-process, on a virtual clock (docs/simulation.md)"
    )
    simulate.add_argument("topology", help="a topology with generator.backend: sim, e.g. configs/sim-paper.yaml")
    check = commands.add_parser("check", help="validate a topology and size every node against its GPUs")
    check.add_argument("topology")
    build = commands.add_parser("build-model", help="build the tiny default model (or a test preset) in a folder")
    build.add_argument("out", help="folder to write the model to (config, safetensors, tokenizer)")
    build.add_argument("--seed", type=int, default=0, help="seed of the initial weights (and the BPE corpus)")
    build.add_argument(
        "--preset",
        choices=["tiny", "qwen3-bpe"],
        default="tiny",
        help="tiny: the default 0.6 M char-level model; qwen3-bpe: a 29 M Qwen3 with a byte-level BPE tokenizer",
    )
    report = commands.add_parser("report", help="plots and a summary table of a training run")
    report.add_argument(
        "run_dir", help=f"the run directory ({RunDir.METRICS}, {RunDir.TIMELINE}, {RunDir.UTILIZATION})"
    )
    report.add_argument("--out", default=None, help="folder to write the report to (default: RUN_DIR/report)")
    export = commands.add_parser("export", help="the trained policy as a Hugging Face model folder")
    export.add_argument("run_dir", help="the run directory (its newest complete checkpoint is exported)")
    export.add_argument("out", help="the folder to write (config, safetensors, tokenizer, generation config)")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="the checkpoint taken after this step instead")
    which.add_argument(
        "--checkpoint", default=None, help="a checkpoint folder instead (a path, or a name in RUN_DIR/checkpoints)"
    )
    export.add_argument(
        "--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="the weights' dtype (auto: the checkpoint's)"
    )
    export.add_argument("--force", action="store_true", help="replace OUT when it exists and is not empty")
    export.add_argument(
        "--adapters", action="store_true", help="a LoRA run: the adapter folder alone (PEFT format), not merged"
    )
    slurm = commands.add_parser("slurm", help="write an sbatch script for the topology (docs/operating.md)")
    slurm.add_argument("topology", help="the topology YAML file, on a disk the cluster's nodes share")
    slurm.add_argument("--out", default=None, help="where to write the script (default: RUN_DIR/job.sbatch)")
    slurm.add_argument(
        "--partition", action="append", default=[], metavar="ROLE=NAME", help="a role group's partition (repeatable)"
    )
    slurm.add_argument("--time", default=None, help="the job's time limit (sbatch --time)")
    certs = commands.add_parser("certs", help="make a CA and one TLS certificate per node (docs/security.md)")
    certs.add_argument("dir", help="the folder for ca.pem, ca.key and NODE.pem / NODE.key (run.tls.dir)")
    certs.add_argument("--topology", required=True, help="the topology whose nodes get certificates")
    certs.add_argument("--days", type=int, default=365, help="how long each node's certificate is valid")
    certs.add_argument("--renew", action="store_true", help="issue every node's certificate again (same CA)")
    slurm_run = commands.add_parser("slurm-run", help="inside the job: the supervisor (reads the script's table)")
    slurm_run.add_argument("--topology", required=True)
    for action, what in (
        ("status", "every node's state, version, queues, busy fraction and last error, as a table"),
        ("pause", "stop admitting new work (nodes finish what is in flight)"),
        ("resume", "admit new work again"),
        ("drain", "finish in-flight work and stop"),
    ):
        admin = commands.add_parser(action, help=what)
        admin.add_argument("--topology", required=True, help="the topology YAML file")
        admin.add_argument("--node", default=None, help="only this node (default: every node)")
        admin.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each node")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "build-model":
        if args.preset == "qwen3-bpe":
            from rollart.models.qwen3_bpe import main as build_model
        else:
            from rollart.tiny.model import main as build_model

        build_model(["--out", args.out, "--seed", str(args.seed)])
        return 0
    if args.command == "report":
        return _report(Path(args.run_dir), None if args.out is None else Path(args.out))
    if args.command == "export":
        return _export(args)
    try:
        topology = load_topology(args.topology)
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "slurm":
        return _slurm(topology, Path(args.topology), args.out, args.partition, args.time)
    if args.command == "certs":
        return _certs(topology, Path(args.dir), days=args.days, renew=args.renew)
    if args.command == "slurm-run":
        from rollart.launch.slurm import run_job

        return run_job(Path(args.topology).resolve(), sys.stdin.read())
    if args.command in ("status", "pause", "resume", "drain"):
        from rollart import admin_cli

        return admin_cli.run(topology, args.command, args.node, timeout_s=args.timeout)
    if args.command == "simulate":
        return _simulate(topology)
    if args.command == "check":
        from rollart.topology.table import check_report

        lines, problems = check_report(topology)
        print("\n".join(lines))
        if problems:
            print("rollart: " + "\n".join(problems), file=sys.stderr)
            return EXIT_CONFIG
        print(f"{args.topology}: ok, {len(topology.nodes)} nodes")
        return 0

    from rollart.launch.gpus import place_gpus

    try:  # before setting up vLLM (minutes): a topology this machine's GPUs cannot hold is refused at once
        place_gpus(topology).check(topology)
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if (venv := _own_venv(topology)) is not None and importlib.util.find_spec(venv.module) is None:
        return _rerun_in(venv, argv if argv is not None else sys.argv[1:])

    import uvloop

    from rollart.launch.local import Launcher

    launcher = Launcher(topology, args.topology, duration=args.duration, start_timeout=args.start_timeout)
    try:
        return uvloop.run(launcher.run())
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def _certs(topology: Topology, folder: Path, *, days: int, renew: bool) -> int:
    """`rollart certs`: the CA and every node's certificate, the node's addresses in it."""
    from rollart.protocol.certs import NodeName, issue_for_nodes

    wildcard = ("0.0.0.0", "::", "")
    nodes = [NodeName(n.name, tuple(h for h in (n.host, n.admin_host) if h not in wildcard)) for n in topology.nodes]
    try:
        written = issue_for_nodes(folder, nodes, days=days, renew=renew)
    except (OSError, ValueError) as exc:
        print(f"rollart certs: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    for path in written:
        print(path)
    kept = len(nodes) - sum(1 for p in written if p.suffix == ".pem" and p.name != "ca.pem")
    print(f"{folder}: {len(written)} files written; {kept} node certificates kept (--renew to issue them again)")
    return 0


def _simulate(topology: Topology) -> int:
    """Run `topology` in-process and print what happened, in simulated seconds."""
    from rollart.launch.inprocess import check_inprocess, run_inprocess

    run = topology.run
    log = RunDir(topology.run_dir()).node_log("inprocess")
    try:
        check_inprocess(topology)
        if run.model.build_tiny_if_missing and not (Path(run.model.path) / "config.json").exists():
            from rollart.tiny.model import ensure_tiny_model

            print(f"building the tiny model in {run.model.path} (its tokenizer renders the prompts)")
            ensure_tiny_model(Path(run.model.path), seed=run.model.seed)
        steps = run.rollout.steps if run.rollout is not None else None
        print(f"simulating {len(topology.nodes)} nodes in-process for {steps} batches; node logs in {log}")
        done = run_inprocess(topology, log=log)
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    steps_s = done.step_s
    mean = sum(steps_s) / len(steps_s) if steps_s else float("nan")
    print(f"batches {len(done.batches)}, trajectories {done.trajectories}, simulated {done.sim_s:.0f} s")
    print(f"step (simulated s, after the first batch): mean {mean:.1f}; each {[round(s, 1) for s in steps_s]}")
    print("generators busy: " + ", ".join(f"{name} {busy:.0%}" for name, busy in done.generator_busy.items()))
    if done.reward is not None and done.reward.cold_starts.count:
        print(f"reward workers: utilization {done.reward.utilization:.0%}, peak {done.reward.peak_workers}")
    print(f"this machine: {done.wall_s:.1f} s, {done.cpu_s:.1f} CPU s")
    return 0


def _slurm(topology: Topology, path: Path, out: str | None, partition: list[str], time_limit: str | None) -> int:
    from rollart.launch.slurm import sbatch_script

    try:
        pairs = [item.split("=", 1) for item in partition]
        if any(len(pair) != 2 for pair in pairs):
            raise ConfigError(f"--partition: expected ROLE=NAME; got {partition}")
        script = sbatch_script(topology, path.resolve(), partitions=dict(pairs), time_limit=time_limit)
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    topology.run_dir().mkdir(parents=True, exist_ok=True)  # Slurm fails a job whose output folder is missing
    target = Path(out) if out is not None else RunDir(topology.run_dir()).sbatch
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(script)
    target.chmod(0o755)
    print(f"wrote {target}: submit it with `sbatch {target}`")
    if topology.run.tls is None and not topology.run.insecure:
        print(
            "rollart slurm: note: the job's nodes listen on their hosts' addresses, and without run.tls "
            "(rollart certs) or run.insecure: true the job refuses them when it starts (docs/security.md)",
            file=sys.stderr,
        )
    return 0


def _report(run_dir: Path, out: Path | None) -> int:
    from rollart.report import ReportError, build_report

    try:
        report_dir = build_report(run_dir, out)
    except ReportError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"report written to {report_dir / 'report.md'}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """`rollart export`: find the checkpoint in the run folder, then `rollart.training.export`."""
    from rollart.rundir import RunDirError
    from rollart.training.export import ExportError, export_checkpoint

    run = RunDir(args.run_dir)
    try:
        if args.checkpoint is not None:
            given = Path(args.checkpoint)
            checkpoint = given if given.exists() or given.is_absolute() else run.checkpoints / given
        else:
            checkpoint = run.complete_checkpoint(args.step)
        export_checkpoint(
            checkpoint,
            Path(args.out),
            dtype=args.dtype,
            force=args.force,
            adapters=args.adapters,
            progress=lambda line: _say(f"export: {line}"),
        )
    except (ExportError, RunDirError) as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.adapters:
        print(f"exported to {args.out}: load it with peft.PeftModel.from_pretrained(base_model, {args.out!r})")
        return 0
    print(f"exported to {args.out}: load it with transformers.AutoModelForCausalLM.from_pretrained({args.out!r})")
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _own_venv(topology: Topology) -> OwnVenv | None:
    """The environment of its own that the topology's generators' backend lives in (None: none, or no generator
    of the topology starts an engine)."""
    if topology.run.rollout is None or not topology.nodes_with_role(Role.GENERATOR):
        return None
    return generation_backend(topology.run.generator.backend).venv


def _rerun_in(venv: OwnVenv, argv: list[str]) -> int:
    """The topology's generators run a library that lives in its own environment (vLLM): set that up when
    missing (`bin/setup-vllm`, a few minutes the first time) and run this command there."""
    root = Path(__file__).resolve().parents[1]
    folder = Path(os.environ.get(venv.override_env, root / venv.folder))
    if os.environ.get(IN_VENV_ENV):
        missing = f"{venv.module} is not importable even in {folder}; run {venv.setup} ({venv.doc})"
        print(f"rollart: {missing}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"rollart: the generators run {venv.module}: setting up {folder} if needed ({venv.setup})", file=sys.stderr)
    if subprocess.run([str(root / venv.setup)], check=False).returncode != 0:
        print(f"rollart: {venv.setup} failed; see above, or set run.generator.backend: hf", file=sys.stderr)
        return EXIT_CONFIG
    python = str(folder / "bin" / "python")
    os.environ[IN_VENV_ENV] = "1"
    os.execv(python, [python, "-m", "rollart", *argv])


if __name__ == "__main__":
    sys.exit(main())
