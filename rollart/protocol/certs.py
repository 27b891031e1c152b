"""Certificates for TLS between nodes: one certificate authority per deployment, one certificate per node.

`rollart certs DIR --topology FILE` calls `issue_for_nodes`: it makes the CA (`ca.pem`, `ca.key`) unless
DIR has one, then a certificate for each node that lacks one (`NODE.pem`, `NODE.key`): an ECDSA P-256
key, the node's name as the subject's common name (what the handshake checks a peer's claimed identity
against), and its hosts as subject alternative names (what HTTPS clients of the admin endpoint check).
Keys are written owner-only (0600). Two clusters share one CA: make it once, copy `ca.pem` (not `ca.key`)
to both, and issue each cluster's node certificates where its CA key is kept (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

CA_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class NodeName:
    """A node a certificate is issued to: its name (the common name) and the hosts it is reached at."""

    name: str
    hosts: tuple[str, ...] = ()


def _key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rollart"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_ca(common_name: str = "rollart CA", *, days: int = 10 * DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """A self-signed CA: its certificate and its private key, both PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return _pem(cert), _key_pem(key)


def issue(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    node: NodeName,
    *,
    days: int = DEFAULT_DAYS,
    not_before: datetime.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A certificate for `node` signed by the CA, usable by both ends of a connection; PEM cert and key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = _key()
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(node.name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    )
    alt = _alt_names((*node.hosts, "localhost", "127.0.0.1"))
    builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # an EC or RSA CA key
    return _pem(cert), _key_pem(key)


def _pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by its owner only, from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def issue_for_nodes(
    folder: Path, nodes: Iterable[NodeName], *, days: int = DEFAULT_DAYS, renew: bool = False
) -> list[Path]:
    """Make `folder`'s CA unless it has one, and a certificate for each node that lacks one (each one
    when `renew`); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    ca_path, ca_key_path = folder / CA_FILE, folder / CA_KEY_FILE
    if not ca_path.exists():
        ca_cert, ca_key = make_ca()
        ca_path.write_bytes(ca_cert)
        write_private(ca_key_path, ca_key)
        written += [ca_path, ca_key_path]
    if not ca_key_path.exists():
        raise FileNotFoundError(f"{ca_key_path}: the CA's key is needed to issue certificates (ca.pem alone is not)")
    ca_cert, ca_key = ca_path.read_bytes(), ca_key_path.read_bytes()
    for node in nodes:
        cert_path, key_path = folder / f"{node.name}.pem", folder / f"{node.name}.key"
        if cert_path.exists() and not renew:
            continue
        cert, key = issue(ca_cert, ca_key, node, days=days)
        write_private(key_path, key)
        cert_path.write_bytes(cert)
        written += [cert_path, key_path]
    return written
