"""What a topology exposes to the network: a node listening beyond loopback needs TLS, or `run.insecure`.

Sessions carry trajectories and weights, the admin endpoint takes a bearer token: without TLS both
cross the network readable and changeable by anyone on the path (the handshake proves who connects,
not what follows). So a node whose session or admin socket binds beyond loopback is refused unless
`run.tls` is set (with `admin: true` for an admin socket), or `run.insecure: true` says, in so many
words, that the network is trusted. UCX does not encrypt: with TLS, weights go over TLS on TCP.
"""

from __future__ import annotations

import ipaddress
import pathlib
import ssl
from typing import TYPE_CHECKING

from rollart.protocol.tls import NodeTls

if TYPE_CHECKING:
    from rollart.topology import Topology

_LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    """Whether a socket bound to `host` is reachable from this machine only (wildcards are not)."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: the network's


def check_exposure(topology: Topology) -> list[tuple[str, str]]:
    """(YAML path, problem) for each socket beyond loopback that TLS does not protect."""
    run = topology.run
    problems: list[tuple[str, str]] = []
    if run.tls is not None and (transport := run.trainer.weights.transport) in ("ucx", "nccl"):
        what = {"ucx": "UCX", "nccl": "NCCL (or gloo)"}[transport]
        problem = f"{what} does not encrypt; with run.tls weights go over TLS on TCP (transport: auto or tcp)"
        problems.append(("run.trainer.weights.transport", problem))
    if run.insecure:
        return problems
    fix = "set run.tls (make the certificates with `rollart certs`), or run.insecure: true for a trusted network"
    for i, node in enumerate(topology.nodes):
        if run.tls is None and not is_loopback(node.host):
            problems.append((f"nodes[{i}].host", f"{node.host} is beyond loopback and sessions have no TLS: {fix}"))
        if (run.tls is None or not run.tls.admin) and not is_loopback(node.admin_host):
            admin_fix = fix.replace("set run.tls", "set run.tls with admin: true")
            problem = f"{node.admin_host} is beyond loopback and the admin endpoint has no TLS: {admin_fix}"
            problems.append((f"nodes[{i}].admin_host", problem))
    return problems


def node_tls(topology: Topology, name: str) -> NodeTls | None:
    """Node `name`'s TLS from `run.tls`, its files relative to the topology's folder; None without it."""
    spec = topology.run.tls
    if spec is None:
        return None
    return NodeTls(*spec.paths(pathlib.Path(topology.source).parent, name))


def admin_client(topology: Topology) -> tuple[str, ssl.SSLContext | None]:
    """How a client reaches this topology's admin endpoints: the URL scheme, and for HTTPS a context
    that trusts the topology's CA (host names checked against the certificates' alternative names)."""
    spec = topology.run.tls
    if spec is None or not spec.admin:
        return "http", None
    ca, _, _ = spec.paths(pathlib.Path(topology.source).parent, "")
    return "https", NodeTls.admin_client_context(ca)
