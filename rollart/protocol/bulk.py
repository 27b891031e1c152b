"""The bulk data path: large byte payloads (weights) on their own authenticated connection.

Bulk payloads do not go through sessions: they are too large to keep in a resend buffer, and
the weight-sync layer above retries whole versions instead. A bulk connection is a TCP
connection that passed the same handshake with purpose `bulk`; each blob is a `BlobHeader`
message frame followed by one bulk frame. The receiver's kernel writes the payload straight
into its destination buffer (`TcpConnection.bulk_sink`), and the sender writes it from the
caller's buffer in chunks, so no copy is made in user space on either side.
"""

from __future__ import annotations

import uuid
from typing import Any

from rollart.protocol.auth import Identity, client_handshake
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ProtocolError
from rollart.protocol.framing import Connection, TcpConnection, open_tcp
from rollart.protocol.messages import BLOB, BlobHeader
from rollart.protocol.tls import NodeTls


async def open_bulk(
    host: str, port: int, *, local: Identity, secret: bytes, cfg: SessionConfig, tls: NodeTls | None = None
) -> TcpConnection:
    """Open and authenticate a bulk connection to a node's session port (over TLS when `tls` is given)."""
    conn = await open_tcp(
        host,
        port,
        max_frame_bytes=cfg.max_frame_bytes,
        max_bulk_bytes=cfg.max_bulk_bytes,
        timeout=cfg.handshake_timeout_s,
        tls=tls,
    )
    try:
        await client_handshake(
            conn,
            identity=local,
            secret=secret,
            session_id=f"bulk-{uuid.uuid4().hex}",
            purpose="bulk",
            timeout=cfg.handshake_timeout_s,
        )
    except BaseException:
        conn.close()
        raise
    return conn


async def send_blob(
    conn: Connection, name: str, payload: bytes | bytearray | memoryview, meta: dict[str, Any] | None = None
) -> None:
    """Send one named payload; returns when it has been handed to the socket."""
    view = memoryview(payload).cast("B")
    conn.send(BLOB.encode(BlobHeader(name, len(view), meta or {})))
    await conn.send_bulk(view)


async def recv_blob(conn: Connection) -> tuple[BlobHeader, memoryview]:
    """Receive the next blob: its header and its payload."""
    header = BLOB.decode(await conn.recv())
    payload = await conn.recv_bulk()
    if len(payload) != header.nbytes:
        raise ProtocolError(f"blob {header.name!r}: header says {header.nbytes} bytes, frame has {len(payload)}")
    return header, payload
