"""A session server answering `Echo` requests with the same `Echo`: the peer process of the
protocol integration tests.

    python tests/integration/echo_server.py --port P --secret-env VAR [--version N]
        [--heartbeat-interval S] [--heartbeat-deadline S]

It prints `ready` on stdout once listening, logs to stderr, and runs until killed. `--version`
makes it speak another protocol version (to test refusals).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import structlog
import uvloop

from rollart.protocol import auth
from rollart.protocol.auth import Identity
from rollart.protocol.config import SessionConfig
from rollart.protocol.messages import CONTROL, Echo
from rollart.protocol.server import SessionServer
from rollart.protocol.session import Session


class EchoHandler:
    async def on_request(self, session: Session, msg: Any) -> Any:
        if not isinstance(msg, Echo):
            raise TypeError(f"this server only echoes; got {type(msg).__name__}")
        return msg

    async def on_event(self, session: Session, msg: Any) -> None:
        pass


async def serve(args: argparse.Namespace) -> None:
    cfg = SessionConfig(
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_deadline_s=args.heartbeat_deadline,
        handshake_timeout_s=2.0,
    )
    server = SessionServer(
        local=Identity("echo", "generator"),
        secret=os.environ[args.secret_env].encode(),
        channel=CONTROL,
        handler=EchoHandler(),
        cfg=cfg,
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        await server.listen_tcp("127.0.0.1", args.port)
        print("ready", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret-env", required=True, help="environment variable holding the shared secret")
    parser.add_argument("--version", type=int, default=None, help="protocol version to speak")
    parser.add_argument("--heartbeat-interval", type=float, default=0.1)
    parser.add_argument("--heartbeat-deadline", type=float, default=1.0)
    args = parser.parse_args()
    if args.version is not None:
        auth.PROTOCOL_VERSION = args.version  # the handshake reads it from the auth module
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
