"""`rollart status | pause | resume | drain --topology FILE [--node NAME]`: the admin API of every
node of a topology (or one), asked at once, answered as one table.

    status   GET /status: node, role, state, policy version, queue depths, busy fraction, last error
    pause    POST /pause: stop admitting new work (env-hosts stop asking for groups, the trainer
             stops granting them and starts no step); in-flight work goes on
    resume   POST /resume
    drain    POST /drain: finish in-flight work and exit 0

Mutations carry the topology's admin token (`run.admin_token_file`, or the variable that
`run.admin_token_env` names, `ROLLART_ADMIN_TOKEN` by default; failing both, the token `rollart run`
made for its run in `RUN_DIR/admin.token`) as `Authorization: Bearer`.

Exit codes: 0 every node asked answered (and accepted); 1 a node did not answer (not running, or
not reachable), the table says which; 2 bad topology, unknown node or no admin token here;
3 a node refused (wrong or missing token, or admin mutations disabled on it).
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollart.errors import ConfigError
from rollart.rundir import RunDir
from rollart.topology import NodeSpec, Topology
from rollart.topology.exposure import admin_client

EXIT_OK, EXIT_UNREACHABLE, EXIT_CONFIG, EXIT_REFUSED = 0, 1, 2, 3
ACTIONS = ("status", "pause", "resume", "drain")
TIMEOUT_S = 5.0
_WILDCARD = {"0.0.0.0", "::", ""}
ERROR_WIDTH = 60


@dataclass
class Answer:
    """One node's answer: the HTTP status and JSON body, or why there was none."""

    node: NodeSpec
    code: int | None = None
    body: dict[str, Any] | None = None
    error: str | None = None


def admin_url(node: NodeSpec, path: str, scheme: str = "http") -> str:
    """A node's admin endpoint; one bound to every interface is reached at the node's own host."""
    host = node.host if node.admin_host in _WILDCARD else node.admin_host
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"{scheme}://{host}:{node.admin_port}{path}"


async def ask(
    nodes: list[NodeSpec],
    action: str,
    *,
    token: str | None = None,
    timeout_s: float = TIMEOUT_S,
    tls: tuple[str, ssl.SSLContext | None] = ("http", None),
) -> list[Answer]:
    """`action` on every node at once: GET /status, or POST /pause, /resume, /drain with the token;
    `tls`: the scheme and context of `exposure.admin_client`."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    scheme, context = tls
    connector = aiohttp.TCPConnector(ssl=context) if context is not None else None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as http:

        async def one(node: NodeSpec) -> Answer:
            method = "GET" if action == "status" else "POST"
            try:
                async with http.request(method, admin_url(node, f"/{action}", scheme)) as response:
                    body = await response.json(content_type=None)
                    return Answer(node, response.status, body if isinstance(body, dict) else {"body": body})
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                return Answer(node, error=_describe(exc, timeout_s))

        return await asyncio.gather(*(one(node) for node in nodes))


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"not reachable ({exc.os_error.strerror or exc.os_error})"
    return f"{type(exc).__name__}: {exc}"


def status_table(answers: list[Answer]) -> str:
    """One row per node: what `rollart status` prints."""
    rows = [["NODE", "ROLE", "STATE", "VERSION", "QUEUES", "BUSY", "LAST ERROR"]]
    for a in answers:
        if a.code != 200 or a.body is None:
            why = a.error or _refusal(a)
            rows.append([a.node.name, a.node.role.value, "unreachable" if a.error else "error", "-", "-", "-", why])
            continue
        s = a.body
        version = "-" if s.get("version") is None else str(s["version"])
        queues = " ".join(f"{name}={depth}" for name, depth in (s.get("queues") or {}).items()) or "-"
        busy = "-" if s.get("busy") is None else f"{s['busy']:.0%}"
        state = "done" if s.get("done") else str(s.get("state", "?"))
        rows.append([a.node.name, a.node.role.value, state, version, queues, busy, _short(s.get("last_error"))])
    return _render(rows)


def action_table(action: str, answers: list[Answer]) -> str:
    """One row per node: what a pause, resume or drain got."""
    rows = [["NODE", "ROLE", action.upper(), "STATE"]]
    for a in answers:
        if a.code == 200 and a.body is not None:
            rows.append([a.node.name, a.node.role.value, "ok", str(a.body.get("state", "?"))])
        else:
            rows.append([a.node.name, a.node.role.value, a.error or _refusal(a), "-"])
    return _render(rows)


def _refusal(a: Answer) -> str:
    detail = (a.body or {}).get("error", "")
    return f"HTTP {a.code}: {detail}" if detail else f"HTTP {a.code}"


def _short(error: Any) -> str:
    if not error:
        return "-"
    text = " ".join(str(error).split())
    return text if len(text) <= ERROR_WIDTH else text[: ERROR_WIDTH - 3] + "..."


def _render(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def exit_code(answers: list[Answer]) -> int:
    """Refusals first (a script must learn its token is wrong), then nodes that did not answer."""
    if any(a.code in (401, 403) for a in answers):
        return EXIT_REFUSED
    if any(a.code != 200 for a in answers):
        return EXIT_UNREACHABLE
    return EXIT_OK


def run(topology: Topology, action: str, node: str | None, *, timeout_s: float = TIMEOUT_S) -> int:
    """The command: ask, print the table (problems on stderr), return the exit code."""
    try:
        nodes = [topology.node(node)] if node is not None else list(topology.nodes)
        token = None if action == "status" else admin_token(topology)
        tls = admin_client(topology)
    except ConfigError as exc:
        print(f"rollart {action}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    answers = asyncio.run(ask(nodes, action, token=token, timeout_s=timeout_s, tls=tls))
    print(status_table(answers) if action == "status" else action_table(action, answers))
    code = exit_code(answers)
    if code == EXIT_REFUSED:
        print(f"rollart {action}: refused: check the admin token ({_token_source(topology)})", file=sys.stderr)
    elif code == EXIT_UNREACHABLE:
        missing = ", ".join(a.node.name for a in answers if a.code != 200)
        print(f"rollart {action}: no answer from {missing}", file=sys.stderr)
    return code


def admin_token(topology: Topology) -> str:
    """The topology's admin token; failing that, the one `rollart run` made for the run it launched
    (`RUN_DIR/admin.token`)."""
    try:
        return topology.read_admin_token()
    except ConfigError as exc:
        made = RunDir(topology.run_dir()).admin_token
        if made.is_file():
            return made.read_text().strip()
        raise ConfigError(f"{exc}; nor is there a {made} from `rollart run`") from None


def _token_source(topology: Topology) -> str:
    run = topology.run
    made = RunDir(topology.run_dir()).admin_token
    source = f"run.admin_token_file: {run.admin_token_file}" if run.admin_token_file else f"${run.admin_token_env}"
    return f"{source}, or {made} for a run `rollart run` launched"
