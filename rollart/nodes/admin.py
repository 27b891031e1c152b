"""The admin HTTP endpoint every node serves (aiohttp).

    GET  /healthz   200 {"ok": true, ...} while the event loop answers
    GET  /status    JSON: role, state, uptime, sessions and their state, queue depths, paused
    GET  /metrics   Prometheus text format
    POST /pause     stop admitting new work          (Authorization: Bearer <token>)
    POST /resume    admit new work again             (same)
    POST /drain     finish in-flight work and exit 0 (same)

Mutations without the right token get 401; when the node has no admin token configured they
are disabled (403) rather than open. The listener binds to the topology's `admin_host`, which
defaults to 127.0.0.1; with `run.tls` (and its `admin`) it serves HTTPS with the node's certificate.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollart.nodes.metrics import node_registry

if TYPE_CHECKING:
    from rollart.nodes.base import NodeDaemon

log = structlog.get_logger("rollart.admin")


class AdminServer:
    """Serves one daemon's admin endpoint."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon
        self.registry = node_registry(daemon)
        self._runner: web.AppRunner | None = None
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/status", self.status)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_post("/drain", self.drain)
        self.app = app

    async def start(self) -> None:
        spec = self.daemon.spec
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        tls, spec_tls = self.daemon.tls, self.daemon.topology.run.tls
        ssl_context = tls.admin_server if tls is not None and spec_tls is not None and spec_tls.admin else None
        site = web.TCPSite(self._runner, spec.admin_host, spec.admin_port, reuse_address=True, ssl_context=ssl_context)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def healthz(self, request: web.Request) -> web.Response:
        d = self.daemon
        return web.json_response({"ok": True, "node": d.spec.name, "role": d.role.value, "state": d.state()})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.daemon.status())

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _authorized(self, request: web.Request) -> web.Response | None:
        """None when the request carries the admin token; otherwise the refusal to send."""
        token = self.daemon.admin_token
        if not token:
            return web.json_response(
                {"error": "admin mutations are disabled: this node has no admin token configured"}, status=403
            )
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), token.encode()):
            log.warning("admin.unauthorized", path=request.path, remote=request.remote)
            return web.json_response(
                {"error": "missing or wrong admin token (Authorization: Bearer <token>)"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="rollart"'},
            )
        return None

    async def pause(self, request: web.Request) -> web.Response:
        if (refusal := self._authorized(request)) is not None:
            return refusal
        self.daemon.pause()
        return web.json_response({"ok": True, "state": self.daemon.state()})

    async def resume(self, request: web.Request) -> web.Response:
        if (refusal := self._authorized(request)) is not None:
            return refusal
        self.daemon.resume()
        return web.json_response({"ok": True, "state": self.daemon.state()})

    async def drain(self, request: web.Request) -> web.Response:
        if (refusal := self._authorized(request)) is not None:
            return refusal
        self.daemon.request_drain("admin /drain")
        return web.json_response({"ok": True, "state": self.daemon.state()})
