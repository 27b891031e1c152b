"""TLS 1.3 with mutual certificates under the framing: sessions and bulk connections both.

A node with `run.tls` wraps every connection it opens or accepts in TLS 1.3 before the handshake
(`auth.py`) runs inside it: each side presents its certificate, signed by the deployment's CA, and
refuses a peer whose certificate is not (`rollart.protocol.certs` makes them). Then the handshake
proves the shared secret as before, with two additions:
- its proofs cover the channel binding, `TlsPeer.binding`: the SHA-256 fingerprints of the client's
  and the server's certificates. Python's `ssl` has no keying-material exporter, and `tls-unique` is
  undefined for TLS 1.3, so the binding is to the certificates: a handshake relayed between two TLS
  connections (someone holding another CA-signed certificate in the middle) fails its proofs, as the
  two connections' certificate pairs differ;
- a peer's claimed node name (`Hello.node`, `Challenge.node`) must be its certificate's common name.
After the handshake TLS protects every frame: a changed byte fails the record's AEAD tag, and the
connection is dropped (the session resumes on a new one; nothing of the bad record is delivered).

A client connects with `loop.create_connection(ssl=...)` and then waits for the server's verdict on its
certificate (`NodeTls.connect`); a node accepts with its own `TlsListener`, which peeks at each
connection's first byte, so a peer without TLS is told so in plaintext, and sees every failed
handshake. Both ends can tell what went wrong: an untrusted or expired certificate, a peer that does
not speak TLS. Those end in `TlsRefused`, a `ProtocolError`: a session gives up on it at once instead
of retrying what cannot work.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import socket
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from rollart.errors import ConfigError
from rollart.protocol.errors import ConnectionClosed, ProtocolError

if TYPE_CHECKING:
    from rollart.protocol.framing import TcpConnection

log = structlog.get_logger("rollart.protocol.tls")


class TlsSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where a node finds its TLS files (`run.tls`); `rollart certs DIR --topology FILE` writes them."""

    dir: str = "certs"
    """Folder of the files below, relative to the topology's folder (or absolute)."""
    ca: str = "ca.pem"
    """The CA certificate every peer's certificate must be signed by."""
    cert: str = "{node}.pem"
    """This node's certificate; `{node}` is the node's name."""
    key: str = "{node}.key"
    """This node's private key; `{node}` is the node's name."""
    admin: bool = True
    """Serve the admin HTTP endpoint over TLS too (HTTPS with the node's certificate; clients need no
    certificate of their own, the admin token authenticates them)."""

    def paths(self, base: Path, node: str) -> tuple[Path, Path, Path]:
        """The CA, certificate and key files of `node`, relative paths taken from `base`."""
        folder = base / self.dir
        return folder / self.ca, folder / self.cert.format(node=node), folder / self.key.format(node=node)


class TlsRefused(ProtocolError):
    """A TLS connection could not be set up for a reason retrying will not change: a certificate the
    other side does not trust (expired, signed by another CA), or a peer that does not speak TLS."""


class PlaintextPeer(TlsRefused):
    """The peer opened a connection to a TLS node without TLS (its first byte is no TLS record): the
    node answers it in plaintext, with a refusal that says so, instead of dropping it unexplained."""


@dataclass(frozen=True)
class TlsPeer:
    """What TLS established about the other end of a connection."""

    name: str
    """The common name of its certificate: the node it was issued to."""
    binding: bytes
    """SHA-256 of the client's certificate, then SHA-256 of the server's: what both handshake proofs cover."""


def _fingerprint(der: bytes) -> bytes:
    return hashlib.sha256(der).digest()


def _common_name(cert: dict[str, object]) -> str:
    for rdn in cert.get("subject", ()):  # type: ignore[attr-defined]  # getpeercert()'s nested tuples
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})
"""OpenSSL's reasons for bytes that are not TLS at all."""
_REFUSED_WORDS = ("CERTIFICATE", "UNKNOWN_CA", "HANDSHAKE_FAILURE", "PROTOCOL_VERSION", "ACCESS_DENIED")
"""Words of OpenSSL's reasons (its alerts included: `SSLV3_ALERT_CERTIFICATE_EXPIRED`) for a peer that will
not accept this one, or the other way round. A record that fails its tag (`DECRYPTION_FAILED_OR_BAD_RECORD_MAC`,
and the peer's `BAD_RECORD_MAC` alert) is not among them: that is tampering or a broken link, and the
session drops the connection and resumes on a new one."""


def refusal(exc: BaseException) -> TlsRefused | None:
    """`exc` as a `TlsRefused` when it is a TLS failure that retrying will not mend (an untrusted
    certificate, either way; a peer without TLS), else None: a reset, an EOF or a record that fails
    its tag is the network's (or an attacker's), and a new connection may well succeed."""
    if not isinstance(exc, ssl.SSLError):
        return None
    reason = getattr(exc, "reason", None) or ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TlsRefused(
            f"its certificate is not trusted: {exc.verify_message} (is it signed by run.tls's CA, and current?)"
        )
    if reason in _NOT_TLS:
        return TlsRefused("it does not speak TLS (is run.tls set in its topology too?)")
    if any(word in reason for word in _REFUSED_WORDS):
        return TlsRefused(f"it refused this node's certificate or TLS version ({reason.lower().replace('_', ' ')})")
    return None


class NodeTls:
    """One node's TLS: its contexts for both ends of a connection, and how a connection is upgraded."""

    def __init__(self, ca: Path, cert: Path, key: Path) -> None:
        for what, path in (("CA certificate", ca), ("certificate", cert), ("key", key)):
            if not path.is_file():
                raise ConfigError(f"run.tls: no {what} at {path} (make them with `rollart certs`)")
        self.name, self.fingerprint = _check_certificate(cert)
        self.server = self._context(ssl.PROTOCOL_TLS_SERVER, ca, cert, key)
        self.client = self._context(ssl.PROTOCOL_TLS_CLIENT, ca, cert, key)
        # The client knows which node it wants; the handshake checks that name against the server's
        # certificate, so no host name is matched here (nodes are reached at any address).
        self.client.check_hostname = False
        self.admin_server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.admin_server.minimum_version = ssl.TLSVersion.TLSv1_3
        self.admin_server.load_cert_chain(cert, key)

    @staticmethod
    def _context(protocol: int, ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=ca)
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ConfigError(f"run.tls: {cert} / {key}: {exc.reason or exc}") from exc
        return ctx

    @staticmethod
    def admin_client_context(ca: Path) -> ssl.SSLContext:
        """A context for HTTPS clients of admin endpoints: trusts `ca`, checks host names."""
        if not ca.is_file():
            raise ConfigError(f"run.tls: no CA certificate at {ca} (make it with `rollart certs`)")
        ctx = ssl.create_default_context(cafile=ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        return ctx

    def peer(self, conn: TcpConnection, *, server_side: bool) -> TlsPeer:
        """What the TLS under `conn` established: the peer's name and the channel binding."""
        obj = conn.transport.get_extra_info("ssl_object")
        der = obj.getpeercert(binary_form=True)
        peer_fp = _fingerprint(der)
        binding = peer_fp + self.fingerprint if server_side else self.fingerprint + peer_fp
        return TlsPeer(_common_name(obj.getpeercert()), binding)

    async def connect(
        self, factory: Callable[[], TcpConnection], host: str, port: int, *, timeout: float
    ) -> TcpConnection:
        """Open a TLS connection to `host:port` and wait for the server to accept this node's certificate;
        raises `TlsRefused` for a certificate or protocol failure, `OSError`/`TimeoutError` for the network's."""
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(factory, host, port, ssl=self.client, ssl_handshake_timeout=timeout)
        except ssl.SSLError as exc:
            raise refusal(exc) or ConnectionResetError(f"TLS handshake with {host}:{port} broke off: {exc}") from exc
        try:
            # In TLS 1.3 the client's handshake ends before the server has checked the client's certificate.
            # Wait for the server's verdict (its session tickets, sent once it accepted us, or its alert)
            # before sending anything: a refusing server that still had our first frame unread would
            # reset the connection, and the alert saying why would be lost with it.
            obj = conn.transport.get_extra_info("ssl_object")
            async with asyncio.timeout(timeout):
                while not (obj.session is not None and obj.session.has_ticket):
                    if conn.closed:
                        await _verdict(conn)
                    await asyncio.sleep(0.002)  # TLS says nothing when tickets arrive
            conn.secured(self.peer(conn, server_side=False))
        except BaseException:
            conn.abort()
            raise
        return conn

    async def serve(
        self,
        host: str,
        port: int,
        factory: Callable[[], TcpConnection],
        *,
        on_connection: Callable[[TcpConnection], None],
        on_refused: Callable[[str, TlsRefused, TcpConnection | None], None],
        timeout: float,
    ) -> TlsListener:
        """Listen on `host:port`; each connection that completes TLS goes to `on_connection`, each one
        refused (an untrusted certificate, no TLS at all) to `on_refused(peer, why, conn)`, where `conn`
        is the plaintext connection of a peer without TLS (to answer it in words), else None."""
        listener = TlsListener(self, factory, on_connection, on_refused, timeout)
        await listener.start(host, port)
        return listener


class TlsListener:
    """A listening socket whose connections are set up here, not by `loop.create_server`: each accepted
    socket's first byte is peeked first, so that a peer without TLS can be told so in plaintext, and every
    failed handshake is seen and logged (asyncio drops those silently)."""

    def __init__(
        self,
        tls: NodeTls,
        factory: Callable[[], TcpConnection],
        on_connection: Callable[[TcpConnection], None],
        on_refused: Callable[[str, TlsRefused, TcpConnection | None], None],
        timeout: float,
    ) -> None:
        self._tls, self._factory, self._timeout = tls, factory, timeout
        self._on_connection, self._on_refused = on_connection, on_refused
        self._tasks: set[asyncio.Task[None]] = set()
        self.sockets: list[socket.socket] = []

    async def start(self, host: str, port: int) -> None:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sockets.append(sock)
        self._spawn(self._accept(sock))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, say: the next accept may well work
                log.warning("tls.accept_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._admit(sock))

    async def _admit(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer = _address(sock)
        made: list[TcpConnection] = []

        def factory() -> TcpConnection:  # uvloop returns its SSL protocol, not ours: keep ours here
            made.append(self._factory())
            return made[-1]

        try:
            async with asyncio.timeout(self._timeout):
                first = await _peek(sock)
            if not first:
                sock.close()
                return
            if first != _CLIENT_HELLO:
                await loop.connect_accepted_socket(factory, sock)
                plaintext = PlaintextPeer("it does not speak TLS (is run.tls set in its topology too?)")
                self._on_refused(peer, plaintext, made[0])
                return
            await loop.connect_accepted_socket(factory, sock, ssl=self._tls.server, ssl_handshake_timeout=self._timeout)
            conn = made[0]
        except ssl.SSLError as exc:
            why = refusal(exc)
            if why is None:
                log.debug("tls.broke_off", peer=peer, error=str(exc))
            else:
                self._on_refused(peer, why, None)
            return
        except (OSError, TimeoutError) as exc:
            sock.close()
            log.debug("tls.broke_off", peer=peer, error=str(exc) or type(exc).__name__)
            return
        conn.secured(self._tls.peer(conn, server_side=True))
        self._on_connection(conn)

    def close(self) -> None:
        """Stop accepting; connections being set up are dropped (those set up are their owner's)."""
        for task in self._tasks:
            task.cancel()
        for sock in self.sockets:
            sock.close()


_CLIENT_HELLO = b"\x16"
"""The first byte of every TLS connection: a handshake record (its ClientHello)."""


def _address(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


async def _peek(sock: socket.socket) -> bytes:
    """The first byte waiting on `sock` (accepted, not yet any transport's), left there for TLS to read;
    b"" when the peer closed."""
    loop = asyncio.get_running_loop()
    while True:
        readable: asyncio.Future[None] = loop.create_future()

        def wake(readable: asyncio.Future[None] = readable) -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(sock.fileno(), wake)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())
        try:
            return sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:  # woken before the bytes were there
            continue


async def _verdict(conn: TcpConnection) -> None:
    """Raise what ended `conn` before the server accepted this node: its alert as `TlsRefused`, or, when
    the connection just closed (asyncio drops a refusing server's alert with the connection), a reset
    that says what it likely means; retried, as a restarting server looks the same."""
    try:
        await conn.recv()
    except ConnectionClosed as exc:
        raise ConnectionResetError(
            f"{conn.peer} closed the connection before accepting this node's certificate: it may not trust it "
            "(expired, or signed by another CA; its log says which)"
        ) from exc


def _check_certificate(path: Path) -> tuple[str, bytes]:
    """This node's certificate: its common name and fingerprint; an expired or unreadable one is refused
    here, with its dates, rather than by every peer later."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as exc:
        raise ConfigError(f"run.tls: {path} is not a PEM certificate: {exc}") from exc
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(
            f"run.tls: {path} is valid from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now: renew it (`rollart certs --renew`)"
        )
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    from cryptography.hazmat.primitives import serialization

    return (str(names[0].value) if names else ""), _fingerprint(cert.public_bytes(serialization.Encoding.DER))
