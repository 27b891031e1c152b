"""What a topology may expose without TLS (`rollart.topology.exposure`), and `rollart certs`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.cli import main
from rollart.errors import ConfigError
from rollart.topology import parse_topology

NODES = """
nodes:
  - {name: trainer, role: trainer, host: "HOST", port: 7100, admin_port: 7200, admin_host: "ADMIN"}
  - {name: gen-0, role: generator, host: 127.0.0.1, port: 7101, admin_port: 7201}
"""


def topology(run: str = "", host: str = "127.0.0.1", admin: str = "127.0.0.1") -> str:
    return (f"run:\n{run}\n" if run else "") + NODES.replace("HOST", host).replace("ADMIN", admin)


def test_tls_required_beyond_loopback() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_topology(topology(host="10.0.0.1"), "t.yaml")
    assert "t.yaml: nodes[0].host: 10.0.0.1 is beyond loopback and sessions have no TLS" in str(refused.value)
    assert "rollart certs" in str(refused.value) and "insecure: true" in str(refused.value)
    for host in ("0.0.0.0", "node-a.example"):
        with pytest.raises(ConfigError, match=r"nodes\[0\]\.host"):
            parse_topology(topology(host=host))
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        parse_topology(topology(host=host))


def test_tls_or_insecure_lets_nodes_listen_beyond_loopback() -> None:
    assert parse_topology(topology("  tls: {dir: certs}", host="10.0.0.1")).run.tls is not None
    assert parse_topology(topology("  insecure: true", host="10.0.0.1", admin="0.0.0.0")).run.insecure


def test_tls_admin_beyond_loopback_needs_https() -> None:
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.admin_host: 0\.0\.0\.0 is beyond loopback and the admin"):
        parse_topology(topology("  tls: {dir: certs, admin: false}", admin="0.0.0.0"))
    parse_topology(topology("  tls: {dir: certs}", admin="0.0.0.0"))


def test_tls_refuses_ucx_weights() -> None:
    with pytest.raises(ConfigError, match="UCX does not encrypt"):
        parse_topology(topology("  tls: {dir: certs}\n  trainer: {weights: {transport: ucx}}"))


def test_tls_node_files_missing_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(topology("  tls: {dir: certs}"))
    from rollart.topology import load_topology

    with pytest.raises(
        ConfigError, match=r"run.tls: no CA certificate at .*certs/ca.pem \(make them with `rollart certs`\)"
    ):
        load_topology(path).node_tls("trainer")


def test_tls_certs_command_issues_one_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(topology("  tls: {dir: certs}", host="10.0.0.1"))
    assert main(["certs", str(tmp_path / "certs"), "--topology", str(path)]) == 0
    from rollart.topology import load_topology

    loaded = load_topology(path)
    tls = loaded.node_tls("trainer")
    assert tls is not None and tls.name == "trainer"
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "certs" / "trainer.pem").read_bytes())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "10.0.0.1" in {str(ip) for ip in alt.get_values_for_type(x509.IPAddress)}
    assert main(["certs", str(tmp_path / "certs"), "--topology", str(path)]) == 0
    assert "0 files written" in capsys.readouterr().out.splitlines()[-1]
