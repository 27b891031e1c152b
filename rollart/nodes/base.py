"""The daemon every node role is built on.

A `NodeDaemon` is one asyncio program: it listens for sessions on its topology port, opens a
client session to every node its role talks to, serves the admin HTTP endpoint, and runs the
role's own work, all as tasks of one `asyncio.TaskGroup` so that any crash surfaces. SIGTERM
and SIGINT (or `POST /drain`) start a drain: new work is refused, in-flight work is given
`run.drain_timeout_s` to finish, sessions are closed with `Bye`, and `run()` returns so the
process exits 0.

A role subclasses it, sets `role`, and overrides `work()` (its long-lived loop),
`on_role_request()` / `on_role_event()` (its messages) and `queue_depths()` (for `/status`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import pathlib
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

import structlog

from rollart.errors import RollartError
from rollart.nodes.admin import AdminServer
from rollart.protocol import (
    ClientSession,
    Connection,
    Identity,
    Session,
    SessionServer,
    State,
    tcp_connector,
)
from rollart.protocol.errors import ProtocolError, RemoteError
from rollart.protocol.memory import MemoryNetwork
from rollart.protocol.messages import APP, Echo, NodeStatus, Notice, StatusRequest
from rollart.topology import NodeSpec, Topology
from rollart.topology.roles import REWARD_SERVICE, Role

log = structlog.get_logger("rollart.node")

CONNECTS_TO: dict[Role, tuple[Role, ...]] = {
    Role.TRAINER: (Role.GENERATOR,),
    Role.GENERATOR: (),
    Role.ENV_HOST: (Role.TRAINER, Role.GENERATOR, Role.REWARD_GATEWAY),
    Role.REWARD_GATEWAY: (),
}
"""Who opens a session to whom (DESIGN.md, "Shape"); the other side accepts."""


def memory_address(host: str, port: int) -> str:
    """Where a node listens in-process (`MemoryNetwork`): its TCP address, unique across topologies."""
    return f"{host}:{port}"


PEER_POLL_S = 2.0
"""How often a node asks the peers it connects to for their status."""


class NodeDaemon:
    """One node of a topology. Subclasses set `role` and add their work."""

    role: ClassVar[Role]

    def __init__(
        self,
        topology: Topology,
        spec: NodeSpec,
        *,
        secret: bytes,
        admin_token: str | None,
        network: MemoryNetwork | None = None,
        other_secrets: Mapping[str, bytes] | None = None,
    ) -> None:
        """`network`: run in-process (`rollart.launch.inprocess`): sessions go over this in-memory
        network, addressed by host and port as over TCP, and the node has no TCP listener, admin
        endpoint or signal handlers of its own. `other_secrets`: the secrets of sessions with other
        runs (`Topology.other_secrets`), read with the run's own."""
        if spec.role is not self.role:
            raise RollartError(f"node {spec.name!r} has role {spec.role.value}; this daemon is a {self.role.value}")
        self.topology = topology
        self.spec = spec
        self.cfg = topology.run.session
        self.identity = Identity(spec.name, spec.role.value)
        self.admin_token = admin_token
        self.secret = secret
        self.started_at = time.time()
        self.paused = False
        self.draining = False
        self.unpaused = asyncio.Event()
        """Set while the node admits new work; role loops wait on it."""
        self.unpaused.set()
        self.last_error: str | None = None
        self.peer_status: dict[str, NodeStatus] = {}
        # In-process nodes talk over memory: nothing to encrypt.
        self.tls = topology.node_tls(spec.name) if network is None else None
        self.server = SessionServer(
            local=self.identity,
            secret=secret,
            channel=APP,
            handler=self,
            cfg=self.cfg,
            on_bulk=self.on_bulk,
            tls=self.tls,
            roles={node.name: node.role.value for node in topology.nodes},
            jobs=other_secrets if spec.role is Role.REWARD_GATEWAY else None,
        )
        self.network = network
        self.clients: dict[str, ClientSession] = {}
        # A member of a trainer group (`primary:`) only runs ranks: it has no sessions either way.
        connects_to = CONNECTS_TO[self.role] if spec.primary is None else ()
        for peer in topology.nodes:
            if peer.role in connects_to and peer.name != spec.name and peer.primary is None:
                connector: Callable[[], Awaitable[Connection]] = (
                    functools.partial(tcp_connector, peer.host, peer.port, self.cfg, self.tls)
                    if network is None
                    else functools.partial(network.connect, memory_address(peer.host, peer.port), spec.name)
                )
                self.clients[peer.name] = ClientSession(
                    connector,
                    secret=secret,
                    local=self.identity,
                    channel=APP,
                    handler=self,
                    cfg=self.cfg,
                    peer_name=peer.name,
                )
        service = topology.run.reward_service
        if self.role is Role.ENV_HOST and service is not None:  # another run's gateway: its own secret
            job = service.job or topology.run.name
            if REWARD_SERVICE not in (other_secrets or {}):
                raise RollartError(f"env-host {spec.name}: run.reward_service is set but no secret for it was read")
            self.clients[REWARD_SERVICE] = ClientSession(
                functools.partial(tcp_connector, service.host, service.port, self.cfg, self.tls)
                if network is None
                else functools.partial(network.connect, memory_address(service.host, service.port), spec.name),
                secret=(other_secrets or {})[REWARD_SERVICE],  # checked above
                local=Identity(f"{job}/{spec.name}", spec.role.value),
                channel=APP,
                handler=self,
                cfg=self.cfg,
                peer_name=REWARD_SERVICE,
            )
        self.admin = AdminServer(self)
        self._drain_requested = asyncio.Event()
        self._stopped = asyncio.Event()

    # -- lifetime -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until drained. Raises if a long-lived task fails (the process then exits non-zero)."""
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self.network is None else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_drain, f"signal {sig.name}")
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.server.serve())
                if self.network is None:
                    await self.server.listen_tcp(self.spec.host, self.spec.bind_port)
                    await self.admin.start()
                else:
                    self.network.listen(memory_address(self.spec.host, self.spec.port), self.server.accept)
                for client in self.clients.values():
                    tg.create_task(client.run())
                work = tg.create_task(self.work())
                # In-process there is no /status to show peers in, and thousands of nodes polling
                # each other would cost more than the simulation itself.
                watch = tg.create_task(self._watch_peers()) if self.network is None else None
                log.info(
                    "node.started",
                    port=self.spec.bind_port,
                    admin=f"{self.spec.admin_host}:{self.spec.admin_port}",
                    peers=list(self.clients),
                )
                await self._drain_requested.wait()
                await self._drain()
                work.cancel()
                if watch is not None:
                    watch.cancel()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            if self.network is not None:
                self.network.unlisten(memory_address(self.spec.host, self.spec.port))
            await self.admin.stop()
            self._stopped.set()
        log.info("node.stopped")

    def secret_paths(self) -> list[pathlib.Path]:
        """What workers running users' code must not see: the run directory (checkpoints, the run's own
        secret and token), the secret and token files, the TLS keys."""
        run, folder = self.topology.run, pathlib.Path(self.topology.source).parent
        files = [run.secret_file, run.admin_token_file]
        paths = [self.topology.run_dir(), *(folder / f for f in files if f is not None)]
        if run.tls is not None:
            paths.append(folder / run.tls.dir)
        return paths

    def pause(self) -> None:
        """Stop admitting new work (in-flight work goes on)."""
        self.paused = True
        self.unpaused.clear()
        log.info("node.paused")

    def resume(self) -> None:
        self.paused = False
        self.unpaused.set()
        log.info("node.resumed")

    def request_drain(self, why: str) -> None:
        """Start draining (idempotent): refuse new work, finish what is in flight, stop."""
        if not self._drain_requested.is_set():
            log.info("node.drain_requested", why=why)
            self.draining = True
            self._drain_requested.set()

    async def _drain(self) -> None:
        timeout = self.topology.run.drain_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await self.drain_work()
                serving = [task for session in self._sessions() for task in session.serving_tasks()]
                if serving:
                    await asyncio.wait(serving)
        except TimeoutError:
            log.warning("node.drain_timeout", timeout_s=timeout, in_flight=self.in_flight())
        closing = [client.close("draining", timeout=5.0) for client in self.clients.values()]
        await asyncio.gather(*closing, self.server.close("draining", timeout=5.0))

    def _sessions(self) -> list[Session]:
        return [*self.server.sessions.values(), *self.clients.values()]

    def in_flight(self) -> int:
        """Requests this node is serving right now (drain waits for them)."""
        return sum(len(session.serving_tasks()) for session in self._sessions())

    # -- role hooks -----------------------------------------------------------------------------

    async def work(self) -> None:
        """The role's long-lived loop; the base has none."""
        await asyncio.Event().wait()

    async def drain_work(self) -> None:
        """Finish the role's own in-flight work when draining (requests are waited for anyway)."""

    def accepts_while_draining(self, msg: Any) -> bool:
        """Requests that finish work already in flight, which a draining node still takes."""
        return False

    async def on_bulk(self, conn: Connection, peer: Identity) -> None:
        """An authenticated bulk connection (weights); only generators take them."""
        raise ProtocolError(f"{self.spec.name} ({self.role.value}) accepts no bulk connections")

    def node_load(self) -> dict[str, float]:
        """Gauges peers may read from this node's `NodeStatus` (see `NodeStatus.load`)."""
        return {}

    async def on_role_request(self, session: Session, msg: Any) -> Any:
        raise RemoteError("unknown-request", f"a {self.role.value} does not serve {type(msg).__name__} requests")

    async def on_role_event(self, session: Session, msg: Any) -> None:
        log.warning(
            "node.unexpected_event", peer=session.peer.node if session.peer else "?", message=type(msg).__name__
        )

    def queue_depths(self) -> dict[str, int]:
        """The role's queues, for `/status` and metrics."""
        return {}

    def progress(self) -> str:
        """One short line on what the role has done, for the launcher's live status."""
        return ""

    def policy_version(self) -> int | None:
        """The policy version the node works at, for `/status` (None: the role has none)."""
        return None

    def busy_fraction(self) -> float | None:
        """How busy the role's main resource is, 0-1, for `/status` (None: not measured)."""
        return None

    def role_gauges(self) -> dict[str, tuple[str, float]]:
        """The role's own metrics: name -> (help, value), exported as gauges."""
        return {}

    def role_labelled_gauges(self) -> dict[str, tuple[str, str, dict[str, float]]]:
        """The role's gauges with one label: name -> (help, label name, {label value: value})."""
        return {}

    def role_counters(self) -> dict[str, tuple[str, float]]:
        """The role's own counts since the process started: name -> (help, value), exported as
        counters (`NAME_total`)."""
        return {}

    # -- session handler ------------------------------------------------------------------------

    async def on_request(self, session: Session, msg: Any) -> Any:
        match msg:
            case StatusRequest():
                return self.node_status()
            case Echo():
                return msg
            case _ if self.draining and not self.accepts_while_draining(msg):
                raise RemoteError("draining", f"{self.spec.name} is draining and takes no new work")
            case _:
                return await self.on_role_request(session, msg)

    async def on_event(self, session: Session, msg: Any) -> None:
        match msg:
            case Notice(text=text):
                log.info("node.notice", peer=session.peer.node if session.peer else "?", text=text)
            case _:
                await self.on_role_event(session, msg)

    async def _watch_peers(self) -> None:
        """Ask each peer this node connects to for its status, so a stuck peer shows in `/status`."""
        while True:
            for name, client in self.clients.items():
                if client.state is State.UP:
                    try:
                        self.peer_status[name] = await client.request(StatusRequest(), timeout=PEER_POLL_S)
                    except RollartError as exc:
                        self.last_error = f"status of {name}: {exc}"
                        log.warning("node.peer_status_failed", peer=name, error=str(exc))
            await asyncio.sleep(PEER_POLL_S)

    # -- status ---------------------------------------------------------------------------------

    def uptime_s(self) -> float:
        return time.time() - self.started_at

    def node_status(self) -> NodeStatus:
        return NodeStatus(
            self.spec.name, self.role.value, round(self.uptime_s(), 3), self.paused, self.draining, self.node_load()
        )

    def state(self) -> str:
        if self.draining:
            return "draining"
        return "paused" if self.paused else "running"

    def status(self) -> dict[str, Any]:
        """Everything `/status` shows."""
        return {
            "node": self.spec.name,
            "role": self.role.value,
            "hardware": self.spec.hardware,
            "pid": os.getpid(),
            "asyncio_tasks": len(asyncio.all_tasks()),
            "state": self.state(),
            "uptime_s": round(self.uptime_s(), 3),
            "paused": self.paused,
            "draining": self.draining,
            "in_flight": self.in_flight(),
            "version": self.policy_version(),
            "busy": None if (busy := self.busy_fraction()) is None else round(busy, 4),
            "queues": self.queue_depths(),
            "last_error": self.last_error,
            "progress": self.progress(),
            "sessions": {
                "outgoing": [client.describe() for client in self.clients.values()],
                "incoming": [session.describe() for session in self.server.sessions.values()],
            },
            "peers": {
                name: {"role": st.role, "paused": st.paused, "draining": st.draining, "uptime_s": st.uptime_s}
                for name, st in self.peer_status.items()
            },
        }
