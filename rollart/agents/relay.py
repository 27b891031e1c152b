"""Inside an agent's sandbox: a loopback port that leads to the env-host's endpoint, then the agent itself.

A sandbox without the host's network has a loopback of its own, so an agent there cannot reach the
env-host's TCP port. The env-host's endpoint also listens on a Unix socket that the sandbox shows read-only;
this relay listens on `127.0.0.1:PORT` inside the sandbox, carries each connection to that socket, and runs
the agent program as its child with `OPENAI_BASE_URL` pointing at the port: an agent in any language needs
nothing but its usual base URL. The relay exits with the agent's exit status.

    python -m rollart.agents.relay SOCKET PORT -- AGENT_ARGV...
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

CHUNK = 64 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _carry(socket_path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))


async def main(socket_path: str, port: int, argv: list[str]) -> int:
    server = await asyncio.start_server(lambda r, w: _carry(socket_path, r, w), "127.0.0.1", port)
    async with server:
        agent = await asyncio.create_subprocess_exec(*argv)
        return await agent.wait()


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 4 or args[2] != "--":
        sys.exit("usage: python -m rollart.agents.relay SOCKET PORT -- AGENT_ARGV...")
    code = asyncio.run(main(args[0], int(args[1]), args[3:]))
    sys.exit(code if code >= 0 else 128 - code)
