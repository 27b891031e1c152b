"""The systemd unit template, for real: `systemd-analyze verify` prints nothing at all (it only warns
on a misspelled key), and systemd as PID 1 of private namespaces starts a node instance as the
`rollart` user, restarts it after kill -9, and stops it with SIGTERM (a drain, exit 0).

Both need root (namespaces, mounts) and Debian's systemd; the boot also needs a Python outside
/root and /home for the node's venv (the unit's ProtectHome hides home folders), which it builds
once in .cache/systemd-venv with the project's own set-up (bin/rollart-node)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT, free_ports, healthy, http, wait_for

pytestmark = pytest.mark.integration

UNITS = ROOT / "deploy" / "systemd"
SYSTEMD = Path("/lib/systemd/systemd")
SYSTEM_PYTHON = Path("/usr/bin/python3")
NODE = "reward"
UNIT = f"rollart-node@{NODE}.service"


def needs_root_and(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: private mount, pid and cgroup namespaces")
    missing = [tool for tool in tools if shutil.which(tool) is None and not Path(tool).exists()]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: apt-get install systemd util-linux)")


def verify(units: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` of the target and one instance, with the checkout at /opt/rollart
    (verify checks that ExecStart's program exists) in a private mount namespace."""
    script = (
        "set -e; mount --make-rprivate /; mount -t tmpfs tmpfs /opt; mkdir /opt/rollart; "
        f"mount --bind {ROOT} /opt/rollart; "
        f"SYSTEMD_UNIT_PATH={units}: exec systemd-analyze verify --man=no rollart.target {UNIT}"
    )
    return subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, check=False)


def test_the_unit_template_verifies_with_no_output_at_all(tmp_path: Path) -> None:
    needs_root_and("unshare", "systemd-analyze")
    done = verify(UNITS)
    assert (done.returncode, done.stdout + done.stderr) == (0, ""), done.stdout + done.stderr
    # The check can fail: a misspelled key is only a warning, exit 0, but it prints.
    broken = tmp_path / "units"
    shutil.copytree(UNITS, broken)
    unit = broken / "rollart-node@.service"
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restrat=on-failure"))
    done = verify(broken)
    assert done.returncode == 0 and "Unknown key 'Restrat'" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def system_venv() -> Path:
    """A venv of the system Python with the project installed, made by bin/rollart-node's own set-up
    as docs/operating.md says: with the checkout seen at /opt/rollart (in a private mount namespace),
    so the venv and its editable install name /opt/rollart wherever this checkout lives (a checkout
    under /tmp would be hidden from the unit by PrivateTmp)."""
    needs_root_and("unshare")
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"needs {SYSTEM_PYTHON} (>= 3.11): the unit's ProtectHome hides a Python under /root")
    venv = ROOT / ".cache" / "systemd-venv"
    venv.mkdir(parents=True, exist_ok=True)
    (ROOT / ".venv").mkdir(exist_ok=True)  # the mount point /opt/rollart/.venv
    script = (
        "set -e; mount --make-rprivate /; mount -t tmpfs tmpfs /opt; mkdir /opt/rollart; "
        f"mount --bind {ROOT} /opt/rollart; mount --bind {venv} /opt/rollart/.venv; "
        f"PYTHON={SYSTEM_PYTHON} exec /opt/rollart/bin/rollart-node --help"
    )
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, check=False)
    if done.returncode == 2 and "needs Python >= 3.11" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def kill_pid_namespace(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the PID 1 that `unshare --fork` started (and so its whole namespace), then unshare."""
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=10)


class Container:
    """systemd as PID 1 of its own namespaces (tests/integration/systemd_container.sh)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = wait_for(self._systemd_pid, 30, "systemd to start in its namespaces")
        wait_for(self._booted, 90, "systemd to finish booting")

    def _booted(self) -> bool:
        state = self.ctl("systemctl", "is-system-running").stdout.strip()
        return state in ("running", "degraded")  # degraded: a host unit that cannot run in a container

    def _systemd_pid(self) -> int | None:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0]) if children else None

    def ctl(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", "-r", "-w", *command],  # -a enters namespaces; -r -w its root
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )

    def show(self, *properties: str) -> dict[str, str]:
        out = self.ctl("systemctl", "show", UNIT, *(f"--property={p}" for p in properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def stop(self) -> None:
        """Power the container off; SIGKILL to its PID 1 ends every process of its pid namespace."""
        if self.proc.poll() is None:
            self.ctl("systemctl", "poweroff")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_pid_namespace(self.proc)


@pytest.fixture
def container(tmp_path: Path, system_venv: Path) -> Iterator[tuple[Container, int]]:
    needs_root_and("unshare", "nsenter", str(SYSTEMD))
    port, admin_port = free_ports(2)
    config = tmp_path / "config"
    config.mkdir()
    (config / "topology.yaml").write_text(
        "run: {name: systemd-test, reward_pool: {min_workers: 0, max_workers: 1}}\n"
        f"nodes:\n  - {{name: {NODE}, role: reward-gateway, host: 127.0.0.1, port: {port}, admin_port: {admin_port}}}\n"
    )
    (config / "rollart.env").write_text("ROLLART_SECRET=systemd-test-secret\nROLLART_ADMIN_TOKEN=systemd-test-token\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = Path(__file__).with_name("systemd_container.sh")
    log = (tmp_path / "boot.log").open("wb")
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--ipc",
            "--cgroup",
            "--mount-proc",
            "bash",
            str(script),
            str(ROOT),
            str(system_venv),
            str(config),
            str(scratch),
            NODE,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    box = None
    try:
        box = Container(proc)
        yield box, admin_port
    finally:
        if box is not None:
            print(box.ctl("journalctl", "--no-pager", "-u", UNIT).stdout[-4000:])
            box.stop()
        else:
            kill_pid_namespace(proc)
        log.close()


@pytest.mark.slow  # builds a venv of the system Python once (a minute or two), then boots systemd
@pytest.mark.timeout(600)
def test_systemd_starts_restarts_and_drains_a_node(container: tuple[Container, int]) -> None:
    box, admin_port = container
    wait_for(lambda: healthy(admin_port), 120, f"{UNIT} to answer /healthz")
    first = box.show("MainPID", "User", "ActiveState", "NRestarts")
    assert first["ActiveState"] == "active" and first["NRestarts"] == "0", first
    assert box.ctl("ps", "-o", "user=", "-p", first["MainPID"]).stdout.strip() == "rollart"
    code, status = http("GET", admin_port, "/status")
    assert code == 200 and status["node"] == NODE and status["pid"] == int(first["MainPID"]), status

    # kill -9: systemd restarts it (Restart=on-failure), and the new process answers.
    killed = time.monotonic()
    box.ctl("kill", "-9", first["MainPID"])
    wait_for(lambda: box.show("NRestarts")["NRestarts"] == "1", 30, "systemd to restart the node")
    wait_for(lambda: healthy(admin_port), 120, "the restarted node to answer /healthz")
    second = box.show("MainPID", "ActiveState")
    assert second["ActiveState"] == "active" and second["MainPID"] != first["MainPID"], second
    print(f"restarted and healthy {time.monotonic() - killed:.1f} s after kill -9")

    # systemctl stop: SIGTERM, the node drains and exits 0; the unit ends inactive, not failed.
    stop = box.ctl("systemctl", "stop", UNIT)
    assert stop.returncode == 0, stop.stderr
    ended = box.show("ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    assert ended == {"ActiveState": "inactive", "Result": "success", "ExecMainCode": "1", "ExecMainStatus": "0"}, ended
    journal = box.ctl("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
    assert '"event": "node.drain_requested"' in journal or "node.drain_requested" in journal, journal[-2000:]
