"""The wire: messages, framing, handshake and persistent sessions. Imports nothing of rollart but `rollart.errors`.

Typical use (see `tests/unit/test_session.py` for more):

    server = SessionServer(local=Identity("gen-0", "generator"), secret=s, channel=CONTROL,
                           handler=my_handler, cfg=SessionConfig())
    tg.create_task(server.serve()); await server.listen_tcp("127.0.0.1", 7101)

    client = ClientSession(lambda: tcp_connector("127.0.0.1", 7101, cfg), secret=s,
                           local=Identity("env-0", "env-host"), channel=CONTROL, cfg=cfg)
    tg.create_task(client.run())
    reply = await client.request(Echo(1), timeout=5.0)
"""

from rollart.protocol.auth import Identity
from rollart.protocol.bulk import open_bulk, recv_blob, send_blob
from rollart.protocol.client import ClientSession, tcp_connector
from rollart.protocol.config import PROTOCOL_VERSION, SessionConfig
from rollart.protocol.framing import Connection, TcpConnection, open_tcp
from rollart.protocol.memory import MemoryConnection, MemoryNetwork
from rollart.protocol.messages import CONTROL, Channel
from rollart.protocol.server import SessionServer
from rollart.protocol.session import Handler, Session, SessionStats, State

__all__ = [
    "CONTROL",
    "PROTOCOL_VERSION",
    "Channel",
    "ClientSession",
    "Connection",
    "Handler",
    "Identity",
    "MemoryConnection",
    "MemoryNetwork",
    "Session",
    "SessionConfig",
    "SessionServer",
    "SessionStats",
    "State",
    "TcpConnection",
    "open_bulk",
    "open_tcp",
    "recv_blob",
    "send_blob",
    "tcp_connector",
]
