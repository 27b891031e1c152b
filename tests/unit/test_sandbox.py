"""Worker sandboxes: real ones, with each tool that works here, against what a hostile env tries.

Each test runs a small `python -I -c` program through `rollart.workers.sandbox.wrap` and checks what
it could do. The hostile ones (`pytest -k hostile_env`) replay what an env module did to a run
started as root: read the node's secrets from `/proc/<pid>/environ`, connect to the node's ports,
write outside any scratch directory; and what else a program may try: a root-only file, a full
scratch, a fork bomb. A tool that does not work here (not installed, namespaces refused) is
skipped with what it said.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from rollart.workers import sandbox
from rollart.workers.sandbox import SandboxSpec, SandboxUnavailable, probe, unreachable, wrap
from rollart.workers.spawn import returncode

ROOT = os.geteuid() == 0


def _python() -> str | None:
    """An interpreter the sandbox's user can run: the tests' own unless it lives where it cannot
    reach (a root's pyenv under /root), else the system's; the programs need the stdlib alone."""
    for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if candidate and not unreachable([candidate, os.path.realpath(candidate)]):
            return candidate
    return None


PYTHON = _python()


@pytest.fixture(params=sandbox.TOOLS)
def tool(request: pytest.FixtureRequest) -> str:
    reason = sandbox._trial(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} does not work here: {reason}")
    if PYTHON is None:
        pytest.skip("no interpreter the sandbox's user can reach")
    return str(request.param)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory of the host the sandbox's user can reach (pytest's own tmp_path is 0700 under
    /tmp/pytest-of-root), shown inside with `read_only` since the sandbox's /tmp is its own."""
    path = Path(tempfile.mkdtemp(prefix="rollart-sandbox-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def run(tool: str, program: str, *, pass_fds: tuple[int, ...] = (), **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run `program` in a sandbox of `tool`; `kwargs` are SandboxSpec's fields and `wrap`'s paths."""
    spec_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in SandboxSpec.__struct_fields__}
    spec = SandboxSpec(mode=tool, **spec_fields)
    argv = wrap([str(PYTHON), "-I", "-c", program], spec, **kwargs)
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, pass_fds=pass_fds, check=False)


def result(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_hostile_env_reads_proc_environ(tool: str) -> None:
    node = subprocess.Popen(["sleep", "30"], env={"ROLLART_SECRET": "s3cret", "ROLLART_ADMIN_TOKEN": "adm1n"})
    try:
        program = f"""
import json, os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
read = {{}}
for pid in (*pids, {node.pid}, {os.getpid()}):
    try:
        with open(f"/proc/{{pid}}/environ", "rb") as f:
            read[pid] = f.read().decode(errors="replace")
    except OSError as exc:
        read[pid] = exc.errno
print(json.dumps({{"pids": pids, "read": read, "session": os.getsid(0)}}))
"""
        seen = result(run(tool, program))
    finally:
        node.kill()
        node.wait()
    assert len(seen["pids"]) <= 3, seen["pids"]  # its init, the program (its /proc is its own)
    assert node.pid not in seen["pids"] and os.getpid() not in seen["pids"]
    assert seen["read"][str(node.pid)] == errno.ENOENT and seen["read"][str(os.getpid())] == errno.ENOENT
    assert "s3cret" not in json.dumps(seen) and "adm1n" not in json.dumps(seen)
    assert seen["session"] != 0  # its session's leader is in the sandbox: no terminal of the node's


@pytest.mark.skipif(not ROOT, reason="a root-owned file the tests' own user could read anyway")
def test_hostile_env_reads_root_only_file(tool: str, shared: Path) -> None:
    (shared / "secret").write_text("s3cret")
    (shared / "secret").chmod(0o600)
    (shared / "public").write_text("hello")
    program = """
import json, os
out = {"uid": os.getuid()}
for name in ("secret", "public"):
    try:
        out[name] = open(name).read()
    except OSError as exc:
        out[name] = exc.errno
print(json.dumps(out))
"""
    seen = result(run(tool, f"import os; os.chdir({str(shared)!r})\n{program}", read_only=[shared]))
    assert seen["secret"] == errno.EACCES and seen["public"] == "hello"
    assert seen["uid"] != 0  # (root's files show as owned by the overflow uid, 65534, inside)


def test_hostile_env_reads_hidden_paths(tool: str, shared: Path) -> None:
    (shared / "run").mkdir()
    (shared / "run" / "admin_token").write_text("adm1n")
    (shared / "secret_file").write_text("s3cret")
    (shared / "env_module.py").write_text("X = 1")
    program = f"""
import json, os
d = {str(shared)!r}
print(json.dumps({{"listing": sorted(os.listdir(d)), "run": os.listdir(d + "/run"),
    "secret_file": open(d + "/secret_file").read(), "module": open(d + "/env_module.py").read()}}))
"""
    seen = result(run(tool, program, read_only=[shared], hide=[shared / "run", shared / "secret_file"]))
    assert seen == {"listing": ["env_module.py", "run", "secret_file"], "run": [], "secret_file": "", "module": "X = 1"}


@pytest.mark.parametrize("network", [False, True])
def test_hostile_env_connects_to_node_port(tool: str, network: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        program = f"""
import json, socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    print(json.dumps("connected"))
except OSError as exc:
    print(json.dumps(exc.errno))
"""
        seen = result(run(tool, program, network=network))
    # (refused by the sandbox's own loopback, or unreachable where that loopback is down)
    assert seen == "connected" if network else seen in (errno.ECONNREFUSED, errno.ENETUNREACH)


def test_hostile_env_writes_outside_scratch(tool: str, shared: Path) -> None:
    shared.chmod(0o777)  # the mode would let it: only the read-only mount stops it
    program = f"""
import json, os
out = {{}}
for path in ({str(shared / "planted")!r}, "/var/tmp/planted", "/etc/planted", "/tmp/fine", "fine_too"):
    try:
        with open(path, "w") as f:
            f.write("x")
        out[path] = "written"
    except OSError as exc:
        out[path] = exc.errno
out["cwd"] = os.getcwd()
print(json.dumps(out))
"""
    seen = result(run(tool, program, read_only=[shared], scratch=PurePosixPath("/tmp/work")))
    assert seen[str(shared / "planted")] == errno.EROFS and seen["/var/tmp/planted"] == errno.EROFS
    assert seen["/etc/planted"] in (errno.EROFS, errno.EACCES)
    assert seen["/tmp/fine"] == seen["fine_too"] == "written" and seen["cwd"] == "/tmp/work"
    assert not (shared / "planted").exists() and not Path("/var/tmp/planted").exists()


def test_hostile_env_fills_scratch(tool: str) -> None:
    program = """
import json
chunk, total = b"x" * (1 << 18), 0
try:
    with open("filler", "wb", buffering=0) as f:
        while total < 64 << 20:
            total += f.write(chunk)
    print(json.dumps([total, None]))
except OSError as exc:
    print(json.dumps([total, exc.errno]))
"""
    total, code = result(run(tool, program, scratch_mb=4))
    assert code == errno.ENOSPC and (3 << 20) <= total <= (4 << 20)


def test_hostile_env_fork_bomb(tool: str) -> None:
    program = """
import json, os, time
forked = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
except OSError as exc:
    print(json.dumps([forked, exc.errno]), flush=True)
"""
    # The sleeping children hold the output pipe: run returns (before its timeout) only because
    # they die with the sandbox's init when the program ends.
    forked, code = result(run(tool, program, max_processes=32))
    assert code == errno.EAGAIN and 8 <= forked < 32
    assert subprocess.run(["true"], check=False).returncode == 0  # the tests' own user forks on


def test_passed_descriptor_works_inside(tool: str) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        program = f"import socket; s = socket.socket(fileno={theirs.fileno()}); s.sendall(s.recv(5)[::-1])"
        ours.sendall(b"hello")
        done = run(tool, program, pass_fds=(theirs.fileno(),))
        assert done.returncode == 0, done.stderr
        assert ours.recv(5) == b"olleh"


def test_unix_socket_in_shown_directory(tool: str, shared: Path) -> None:
    """An agent program's endpoint: a Unix socket of the host, in a directory `read_only` shows
    (below /tmp here, which the sandbox covers with its own), reached without any network."""
    path = shared / "episode.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        path.chmod(0o777)  # connecting takes write permission on the socket, for the sandbox's user
        listener.listen()
        program = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r}); s.sendall(b'hi')"
        done = run(tool, program, read_only=[shared])
        assert done.returncode == 0, done.stderr
        listener.settimeout(5)
        conn, _ = listener.accept()
        with conn:
            assert conn.recv(2) == b"hi"


def test_death_by_signal_reads_as_popen_would(tool: str) -> None:
    done = run(tool, "import os, signal; os.kill(os.getpid(), signal.SIGXCPU)")
    assert done.returncode == 128 + signal.SIGXCPU
    assert returncode(done.returncode) == -signal.SIGXCPU
    assert returncode(0) == 0 and returncode(1) == 1 and returncode(None) is None


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """`probe`'s trials are cached per process: start this test without them and leave none behind."""
    sandbox._trial.cache_clear()
    sandbox._auto.cache_clear()
    yield
    sandbox._trial.cache_clear()
    sandbox._auto.cache_clear()


def test_no_tool_is_a_loud_warning_or_an_error(fresh_probe: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap, no unshare, as on a bare host
    with capture_logs() as logs:
        assert probe("auto") == "off"
        assert probe("auto") == "off"
    assert [entry["event"] for entry in logs] == ["sandbox.unavailable"]  # once per process
    assert logs[0]["log_level"] == "warning" and "not found on PATH" in logs[0]["bwrap"]
    assert "apt-get install bubblewrap" in sandbox.failures()["bwrap"]
    with pytest.raises(SandboxUnavailable, match="'unshare' cannot work here: unshare, setpriv, prlimit, setsid not"):
        probe("unshare")
    assert probe("off") == "off"
    assert wrap(["true"], SandboxSpec(mode="off")) == ["true"]


def test_probe_takes_the_first_tool_that_works() -> None:
    working = [tool for tool in sandbox.TOOLS if sandbox._trial(tool) is None]
    assert probe("auto") == (working[0] if working else "off")
    for tool in sandbox.TOOLS:
        if tool in working:
            assert probe(tool) == tool
        else:
            with pytest.raises(SandboxUnavailable, match=tool):
                probe(tool)


def test_spec_is_checked() -> None:
    assert SandboxSpec().validate() == []
    assert [key for key, _ in SandboxSpec(scratch_mb=0, max_processes=2).validate()] == ["scratch_mb", "max_processes"]
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"mode": "bwrap", "netwrok": True}, SandboxSpec)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"mode": "docker"}, SandboxSpec)


def test_scratch_lies_in_the_private_tmp(tool: str) -> None:
    with pytest.raises(ValueError, match="/tmp or below"):
        wrap(["true"], SandboxSpec(mode=tool), scratch=PurePosixPath("/var/scratch"))


@pytest.mark.skipif(not ROOT, reason="for a root node's sandbox user")
def test_unreachable_names_what_nobody_cannot_reach(shared: Path) -> None:
    closed = shared / "closed"
    closed.mkdir(mode=0o700)
    (closed / "module.py").write_text("")
    assert unreachable([shared, closed, closed / "module.py", shared / "missing"]) == [
        closed / "module.py",
        shared / "missing",
    ]


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(bool(unreachable([REPO / "rollart"])), reason="the sandbox's user cannot reach the repository")
def test_hostile_env_code_task_runs_in_the_sandbox(tool: str) -> None:
    """The `code` task in a sandboxed worker: the model's program, a child of the worker, is in the
    sandbox too. What it tries is what the env module of the threat tried."""
    node = subprocess.Popen(["sleep", "30"], env={"ROLLART_SECRET": "s3cret"})
    with socket.create_server(("127.0.0.1", 0)) as listener:
        hostile = f"""
import json, os, socket
out = {{"pids": len([p for p in os.listdir("/proc") if p.isdigit()])}}
for key, attempt in (("environ", lambda: open("/proc/{node.pid}/environ").read()),
                     ("write", lambda: open({str(REPO / "planted")!r}, "w")),
                     ("port", lambda: socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=3))):
    try:
        attempt()
        out[key] = "done"
    except OSError as exc:
        out[key] = exc.errno
print(json.dumps(out), flush=True)
def solve(*args):
    return None
"""
        worker = f"""
import json, sys
sys.path[:0] = [{str(REPO)!r}]
from rollart.envs import make_env
env = make_env("code", python=sys.executable)
env.reset(seed=0)
obs = env.step({hostile!r})[0]
print(next(line for line in obs.splitlines() if line.startswith("{{")))
"""
        try:
            # A checkout under /tmp (a clean clone) is covered by the sandbox's own /tmp: show it.
            shown = [REPO] if REPO.is_relative_to("/tmp") else []
            seen = result(run(tool, worker, read_only=shown))
        finally:
            node.kill()
            node.wait()
    assert seen["pids"] <= 4  # the sandbox's init, the worker, the program (and the listing's python)
    assert seen["environ"] == errno.ENOENT and seen["write"] == errno.EROFS
    assert seen["port"] in (errno.ECONNREFUSED, errno.ENETUNREACH)
    assert not (REPO / "planted").exists()
