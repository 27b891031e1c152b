"""Where a worker runs: a sandbox of its own namespaces, as another user, on a read-only root.

A worker's command line goes after `launcher(spec, ...)` (or through `wrap`), and then runs:
- as an unprivileged user toward the host's files: a node running as root drops to `nobody`
  (uid and gid 65534, no supplementary groups) *before* the sandbox is made, because a user
  namespace made by root maps its user to root outside and file permissions would still see root;
  a node of another user runs its sandboxes as that user, who owns nothing of root's;
- in new user, pid (a fresh `/proc`: the node's processes and their `environ` are not there),
  ipc, uts and cgroup namespaces, and a network namespace of its own (loopback only: no host port,
  no abstract Unix socket) unless `spec.network`;
- on the host's whole root bound read-only, so the interpreter, `sys.path` and the users' modules
  are where they are on the host, with `hide` masked (the run directory, secret files) and `/tmp`
  and `/dev/shm` private tmpfs of `spec.scratch_mb` each: the only places it can write;
- under `spec.max_processes` (RLIMIT_NPROC, set inside the sandbox, so counted per sandbox on
  Linux >= 5.14) and dead with the node: the sandbox is killed when the process that started it
  dies, and everything in it when its first process ends (the pid namespace's init).
Descriptors the caller passes (`Popen(pass_fds=...)`: the worker's end of its socket pair) stay
open, at the same numbers. It runs in a session of its own (no terminal to type into). Its parent
is the sandbox's init, not the node: `os.getppid()` inside never names the node, and the worker need
not check it (the sandbox dies with the node already). bwrap also forbids further user namespaces.

Two tools make it: `bwrap` (bubblewrap, which the set-up installs where it can) and `unshare`
(util-linux: a shell stage does the mounts, drops every capability with `setpriv` and stays as the
sandbox's init, which reaps orphans). `probe` tries each once per process by running a sandbox;
`auto` takes the first that works and, where none does (a kernel that refuses unprivileged user
namespaces, a container without them), logs `sandbox.unavailable` with what each tool said and
runs workers unsandboxed: loud, never silent. Either tool reports a death by signal n as exit code
128 + n; `rollart.workers.spawn.returncode` turns that back into Popen's -n. Stop a sandbox with SIGKILL to the process
Popen started (`unshare` ignores SIGTERM): everything in it dies.

The user must be able to reach what the worker runs: with a node running as root from `/root`
(pyenv's default), `nobody` cannot reach the interpreter. `unreachable(paths)` names such paths.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Literal

import msgspec
import structlog

from rollart.errors import RollartError
from rollart.workers.spawn import Launch, import_path

log = structlog.get_logger("rollart.workers.sandbox")

Mode = Literal["auto", "bwrap", "unshare", "off"]
Tool = Literal["bwrap", "unshare"]
TOOLS: tuple[Tool, ...] = ("bwrap", "unshare")
NOBODY = 65534
"""The uid and gid a node running as root drops to for its sandboxes."""
TMP = PurePosixPath("/tmp")
PID_MAX_MIN = 301
"""The least pid_max the kernel takes (its reserved pids + 1): a root sandbox's fork ceiling is at least this."""
TRIAL_TIMEOUT_S = 10.0
"""How long `probe`'s trial sandbox may take."""


class SandboxUnavailable(RollartError):
    """The sandbox mode asked for cannot work here; the message says what the tool or kernel said."""


class SandboxSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How worker processes are sandboxed (`rollart.workers.sandbox`)."""

    mode: Mode = "auto"
    """auto: bwrap, else unshare, else none with a loud `sandbox.unavailable` warning; bwrap or
    unshare: that tool, or an error naming what it said; off: no sandbox."""
    network: bool = False
    """Keep the host's network (for an env or reward function that calls a service); without it the
    sandbox has a loopback of its own and nothing else (Unix sockets in `read_only` paths still work)."""
    scratch_mb: int = 256
    """Size of each private tmpfs (`/tmp`, which holds the worker's scratch directory, and `/dev/shm`)
    in MiB, counted in memory."""
    max_processes: int = 256
    """Processes and threads in the sandbox, its init included (RLIMIT_NPROC): a fork bomb's ceiling."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable."""
        lows = (("scratch_mb", 1), ("max_processes", 8))
        return [
            (key, f"expected an integer >= {low}; got {getattr(self, key)}")
            for key, low in lows
            if getattr(self, key) < low
        ]


def sandbox_user(drop: bool = True) -> tuple[int, int]:
    """The uid and gid a sandboxed process has toward the host's files: nobody's for a root node
    (unless `drop` is False: see `worker_launch`)."""
    return (NOBODY, NOBODY) if os.geteuid() == 0 and drop else (os.getuid(), os.getgid())


def unreachable(paths: Iterable[str | Path]) -> list[Path]:
    """Those of `paths` that do not exist or that the sandbox's user cannot get to (a directory above
    one denies it search): a worker's interpreter and `sys.path` must not be among them. By mode
    bits, for a root node (ACLs are not read); otherwise as the caller sees them."""
    uid, gid = sandbox_user()
    return [Path(p) for p in paths if not _reaches(Path(p), uid, gid)]


def _reaches(path: Path, uid: int, gid: int) -> bool:
    if os.geteuid() != 0:
        return os.path.lexists(path)
    path = Path(os.path.abspath(path))
    for directory in reversed(path.parents):
        try:
            st = directory.stat()
        except OSError:
            return False
        shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
        if not (st.st_mode >> shift) & 0o1:
            return False
    return os.path.lexists(path)


@functools.cache
def _trial(tool: Tool) -> str | None:
    """None if a trivial sandbox of `tool` runs here, else what the tool (or the kernel, through it) said."""
    missing = [name for name in (tool, "setpriv", "prlimit", "setsid") if shutil.which(name) is None]
    if missing:
        hint = " (Debian: apt-get install bubblewrap)" if tool == "bwrap" else ""
        return f"{', '.join(missing)} not found on PATH{hint}"
    true = shutil.which("true") or "/bin/true"
    argv = [*_command(tool, SandboxSpec(scratch_mb=1, max_processes=16), (), TMP), true]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"a trial sandbox did not finish in {TRIAL_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"{argv[0]}: {exc}"
    if done.returncode == 0:
        return None
    said = " | ".join(line for line in done.stderr.strip().splitlines()[-3:])
    return f"exit {done.returncode}: {said or '(nothing on stderr)'}"


def failures() -> dict[str, str]:
    """What each tool `probe` tried and found not working said (for a node's /status)."""
    return {tool: reason for tool in TOOLS if (reason := _trial(tool)) is not None}


@functools.cache
def _auto() -> Tool | Literal["off"]:
    for tool in TOOLS:
        if _trial(tool) is None:
            return tool
    log.warning("sandbox.unavailable", mode="auto", running="unsandboxed", **failures())
    return "off"


def probe(mode: Mode = "auto") -> Tool | Literal["off"]:
    """The tool `mode` runs sandboxes with here (tried once per process): `off` for `off`, and for
    `auto` where no tool works (logged once as `sandbox.unavailable`). A tool named in `mode` that
    does not work raises `SandboxUnavailable` with what it said."""
    if mode == "off":
        return "off"
    if mode == "auto":
        return _auto()
    reason = _trial(mode)
    if reason is not None:
        raise SandboxUnavailable(f"sandbox mode {mode!r} cannot work here: {reason}")
    return mode


def _tool(spec: SandboxSpec, drop_user: bool) -> Tool | Literal["off"]:
    """`probe`'s tool, but unshare for a sandbox that keeps uid 0 under `auto`: RLIMIT_NPROC does not
    bind uid 0, and unshare's stage caps the pid namespace's pids instead."""
    tool = probe(spec.mode)
    if tool == "bwrap" and spec.mode == "auto" and sandbox_user(drop_user) == (0, 0) and _trial("unshare") is None:
        return "unshare"
    return tool


def launcher(
    spec: SandboxSpec,
    *,
    hide: Sequence[str | Path] = (),
    read_only: Sequence[str | Path] = (),
    scratch: PurePosixPath = TMP,
    drop_user: bool = True,
) -> list[str]:
    """The command line that goes before a worker's own (empty for no sandbox; see `probe`).

    `hide`: host paths masked inside (a directory by an empty read-only tmpfs, a file by /dev/null):
    the run directory, secret files; one that does not exist, or that the sandbox's user cannot
    reach anyway, is left alone. `read_only`: host paths shown read-only inside although a hidden
    path or the private `/tmp` covers them (a directory holding an episode's Unix socket: connecting
    needs write permission on the socket, for the sandbox's user, not a writable mount); the
    sandbox's user must reach them (`unreachable`), or the sandbox fails to start, saying which.
    `scratch`: the worker's directory, `HOME` and `TMPDIR`: `/tmp` or a directory below it.
    `drop_user`: a root node's sandboxes run as nobody (False: as root in their user namespace)."""
    tool = _tool(spec, drop_user)
    if tool == "off":
        return []
    if scratch != TMP and TMP not in scratch.parents:
        raise ValueError(f"sandbox scratch must be /tmp or below it, got {scratch}")
    uid, gid = sandbox_user(drop_user)
    shown = [Path(os.path.abspath(p)) for p in read_only]
    hidden = [Path(os.path.realpath(p)) for p in hide]
    # A path below /tmp, /dev, /proc or another hidden path is hidden already, unless a shown path
    # brings it back.
    hidden = [
        p
        for p in hidden
        if _reaches(p, uid, gid) and (not _below(p, [*_PRIVATE, *(h for h in hidden if h != p)]) or _below(p, shown))
    ]
    # Deeper paths are mounted later, on top: a socket directory shown inside a hidden run
    # directory, a secret file hidden inside a shown directory.
    layers = sorted([(p, True) for p in hidden] + [(p, False) for p in shown], key=lambda layer: len(layer[0].parts))
    return _command(tool, spec, layers, scratch, drop_user)


def wrap(
    argv: Sequence[str],
    spec: SandboxSpec,
    *,
    hide: Sequence[str | Path] = (),
    read_only: Sequence[str | Path] = (),
    scratch: PurePosixPath = TMP,
) -> list[str]:
    """`argv` run in the sandbox: `launcher`'s command line, then `argv`."""
    return [*launcher(spec, hide=hide, read_only=read_only, scratch=scratch), *argv]


TMP_DIR = Path("/tmp")
_PRIVATE = (TMP_DIR, Path("/dev"), Path("/proc"))
"""What the sandbox replaces with its own."""
Layer = tuple[Path, bool]
"""A host path and whether it is hidden (else shown read-only), in the order they are mounted."""


def _below(path: Path, tops: Iterable[Path]) -> bool:
    return any(path == top or top in path.parents for top in tops)


def _command(
    tool: Tool, spec: SandboxSpec, layers: Sequence[Layer], scratch: PurePosixPath, drop_user: bool = True
) -> list[str]:
    uid, gid = sandbox_user(drop_user)
    drop = (
        ["--reuid", str(uid), "--regid", str(gid), "--clear-groups"] if (uid, gid) != (os.getuid(), os.getgid()) else []
    )
    # setpriv: the uid drop first (a root node), and the sandbox's death with its starter.
    outer = [_which("setpriv"), *drop, "--pdeathsig", "KILL", "--"]
    nproc = [_which("prlimit"), f"--nproc={spec.max_processes}:{spec.max_processes}", "--"]
    size = str(spec.scratch_mb * 2**20)
    hidden_dirs = [str(path) for path, hidden in layers if hidden and path.is_dir()]
    if tool == "bwrap":
        argv = [_which("bwrap"), "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        argv += ["--unshare-cgroup-try", *([] if spec.network else ["--unshare-net"])]
        argv += ["--disable-userns", "--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
        argv += ["--size", size, "--tmpfs", "/tmp"]
        for path, hidden in layers:
            if not hidden:
                argv += ["--ro-bind", str(path), str(path)]
            else:
                # (/dev/null by --dev-bind: a plain bind is nodev, where opening a device fails)
                argv += ["--tmpfs", str(path)] if path.is_dir() else ["--dev-bind", "/dev/null", str(path)]
        argv += ["--remount-ro", "/dev", *(x for path in hidden_dirs for x in ("--remount-ro", path))]
        argv += ["--dir", str(scratch), "--chdir", str(scratch)]
        argv += ["--setenv", "TMPDIR", str(scratch), "--setenv", "HOME", str(scratch), "--", *nproc]
        return [*outer, *argv]
    script = _unshare_stage(spec, layers, hidden_dirs, scratch, nproc)
    argv = [_which("unshare"), "--user", f"--map-user={uid}", f"--map-group={gid}", "--keep-caps"]
    argv += ["--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts", "--cgroup"]
    argv += [] if spec.network else ["--net"]
    return [*outer, *argv, "--", "/bin/sh", "-euc", script, "sandbox"]


def _unshare_stage(
    spec: SandboxSpec, layers: Sequence[Layer], hidden_dirs: Sequence[str], scratch: PurePosixPath, nproc: list[str]
) -> str:
    """The shell that builds the unshare sandbox's mounts (with the user namespace's capabilities,
    kept for it alone), then runs the command without any and stays as its init."""
    q = shlex.quote
    tmpfs = f"mount -t tmpfs -o size={spec.scratch_mb}m,mode=1777,nosuid,nodev tmpfs"
    host = "/dev/shm/.host"  # the host's tree, to bind shown paths from once their covers are on
    shows = any(not hidden for _, hidden in layers)
    pid_max = max(spec.max_processes, PID_MAX_MIN)
    lines = [
        # The pid namespace's own pid_max (Linux >= 6.14): the fork limit that binds uid 0 too, where
        # RLIMIT_NPROC does not. Said on stderr (the node's log) where the kernel refuses it.
        f"echo {pid_max} > /proc/sys/kernel/pid_max 2>/dev/null || echo 'sandbox: no pid limit (kernel < 6.14)' >&2",
        # Every mount read-only but the fresh /proc; a mount that refuses fails the sandbox.
        'while read -r _ _ _ _ m _; do case "$m" in /proc|/proc/*) ;; *) mount -o remount,bind,ro "$m";; esac; done'
        " < /proc/self/mountinfo",
        f"{tmpfs} /dev/shm",
        *([f"mkdir {host}", f"mount --rbind / {host}"] if shows else []),
        f"{tmpfs} /tmp",
    ]
    if not spec.network:
        # A new network namespace's loopback starts down (bwrap brings it up itself): up, so that a worker
        # may listen and connect on it (an agent's relay to its endpoint, `rollart.agents.relay`).
        # Never a reason to fail the sandbox (the stage may run as a user that cannot run this Python):
        # `ip` where there is one, else Python's ioctl, else a word on stderr.
        ip = shutil.which("ip")
        tries = [*([f"{q(ip)} link set lo up"] if ip else []), f"{q(sys.executable)} -c {q(_LOOPBACK_UP)}"]
        lines.insert(1, " || ".join(f"{t} 2>/dev/null" for t in tries) + " || echo 'sandbox: loopback down' >&2")
    for path, hidden in layers:
        where = q(str(path))
        if hidden:
            lines.append(f"mount -t tmpfs tmpfs {where}" if path.is_dir() else f"mount --bind /dev/null {where}")
            continue
        make = f"mkdir -p {where}" if path.is_dir() else f"mkdir -p {q(str(path.parent))}; : > {where}"
        lines += [f"[ -e {where} ] || {{ {make}; }}", f"mount --bind -o ro {q(host + str(path))} {where}"]
    if shows:
        lines += [f"umount -l {host}", f"rmdir {host}"]
    lines += [f"mount -o remount,bind,ro {q(path)}" for path in hidden_dirs]
    lines += [f"mkdir -p {q(str(scratch))}", f"cd {q(str(scratch))}"]
    lines += [f"export TMPDIR={q(str(scratch))} HOME={q(str(scratch))}"]
    caps = [_which("setpriv"), "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    session = [_which("setsid"), "--wait"]  # as bwrap's --new-session: no terminal to push input into
    # In the background, so that this shell stays the pid namespace's init and reaps orphans;
    # `<&0` keeps stdin (a background command's is /dev/null otherwise).
    lines += [f'{shlex.join([*session, *caps, *nproc])} "$@" <&0 &', "wait $!"]
    return "\n".join(lines)


_LOOPBACK_UP = (
    "import fcntl, socket, struct; "
    "fcntl.ioctl(socket.socket(), 0x8914, struct.pack('16sH14x', b'lo', 0x41))"  # SIOCSIFFLAGS: IFF_UP | IFF_RUNNING
)


def _which(name: str) -> str:
    return shutil.which(name) or name


def worker_launch(
    spec: SandboxSpec, *, python: str, hide: Sequence[str | Path], what: str, show: Sequence[str | Path] = ()
) -> Launch:
    """How a pool of `what` (env or reward) workers, or an agent program, starts them: `python` in `spec`'s
    sandbox, `hide` masked (the run directory, the secret and token files, the TLS keys), `show` shown
    read-only although hidden or private (`launcher`'s `read_only`: an agent endpoint's socket directory).

    A root node's workers run as nobody when nobody can reach the interpreter and the import path;
    where it cannot (a Python under `/root`, pyenv's default), they stay root inside their user
    namespace, with a loud `sandbox.runs_as_root` warning: the namespaces, the read-only root and the
    hidden paths still hold, but a file only root may read elsewhere is readable to them. Install
    Python where nobody can read it (`/opt`, `/usr/local`) to close that."""
    tool = probe(spec.mode)
    if tool == "off":
        return Launch(python=python, described="no sandbox")
    drop = True
    if os.geteuid() == 0:
        blocked = unreachable([python, os.path.realpath(python), *import_path(python)])
        if blocked:
            drop = False
            log.warning(
                "sandbox.runs_as_root",
                workers=what,
                unreachable=[str(p) for p in blocked[:3]],
                meaning="nobody cannot reach the interpreter or its imports: workers keep uid 0 in their user "
                "namespace; files only root may read are readable to them, but for the hidden ones",
            )
    # What the worker runs from, where the sandbox's private /tmp and /dev/shm would cover it (a
    # checkout under /tmp): shown read-only; hidden paths below it stay hidden.
    runs_from = [python, os.path.realpath(python), sys.prefix, *import_path(python)]
    shown = sorted({p for p in map(os.path.abspath, runs_from) if _below(Path(p), (TMP_DIR, Path("/dev/shm")))})
    shown = [p for p in shown if not any(q != p and Path(p).is_relative_to(q) for q in shown)]
    argv = launcher(spec, hide=hide, read_only=[*shown, *show], scratch=TMP / "work", drop_user=drop)
    uid, _ = sandbox_user(drop)
    network = "network" if spec.network else "no network"
    return Launch(tuple(argv), python, f"{_tool(spec, drop)} sandbox, uid {uid}, {network}")
