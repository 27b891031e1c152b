"""The `rollart` command line.

    rollart run TOPOLOGY [--duration S]   start every node of the topology here, show their status
    rollart check TOPOLOGY                validate a topology file and print its nodes
    rollart build-model DIR [--seed N]    build the tiny default model (Hugging Face format) in DIR

Exit codes: 0 success; 1 a node failed (the run says which); 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import sys

from rollart.protocol.errors import ConfigError
from rollart.topology import load_topology

EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollart", description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run every node of a topology on this machine")
    run.add_argument("topology", help="the topology YAML file, e.g. configs/local.yaml")
    run.add_argument("--duration", type=float, default=None, help="stop after this many seconds of running")
    run.add_argument("--start-timeout", type=float, default=120.0, help="seconds for every node to become healthy")
    check = commands.add_parser("check", help="validate a topology file")
    check.add_argument("topology")
    build = commands.add_parser("build-model", help="build the tiny default model in a folder")
    build.add_argument("out", help="folder to write the model to (config, safetensors, tokenizer)")
    build.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "build-model":
        from rollart.engines.tiny_model import main as build_model

        build_model(["--out", args.out, "--seed", str(args.seed)])
        return 0
    try:
        topology = load_topology(args.topology)
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check":
        for node in topology.nodes:
            admin = f"{node.admin_host}:{node.admin_port}"
            print(f"{node.name:<16} {node.role.value:<15} {node.host}:{node.port}  admin {admin}")
        print(f"{args.topology}: ok, {len(topology.nodes)} nodes")
        return 0

    import uvloop

    from rollart.launcher import Launcher

    launcher = Launcher(topology, args.topology, duration=args.duration, start_timeout=args.start_timeout)
    try:
        return uvloop.run(launcher.run())
    except ConfigError as exc:
        print(f"rollart: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
