"""Prometheus metrics of a node, read from live state at scrape time.

The hot paths only bump plain integer counters (`SessionStats`); this collector turns them into
Prometheus metric families when `/metrics` is scraped, so messaging pays nothing for metrics.
Every node's registry also carries the standard process metrics (RSS, open fds, CPU time).
The names and labels are listed in docs/metrics.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from rollart.protocol import Session, SessionStats

if TYPE_CHECKING:
    from rollart.nodes.base import NodeDaemon

_SESSION_COUNTERS = {
    "sent": "Session messages sent (first transmissions)",
    "received": "Session messages received and accepted (duplicates excluded)",
    "resent": "Session messages sent again after a reconnect",
    "duplicates": "Session messages received twice and dropped",
    "connects": "Connections established for the session",
    "disconnects": "Connections of the session that ended",
    "silent_peer": "Times the peer was silent past the heartbeat deadline",
    "requests_sent": "Requests sent on the session",
    "requests_served": "Requests from the peer handled on the session",
    "request_timeouts": "Requests that passed their deadline",
    "late_responses": "Responses that arrived after their request was given up",
    "decode_errors": "Messages that failed to decode",
    "handler_errors": "Handlers that raised an unexpected exception",
}
assert set(_SESSION_COUNTERS) == {f.name for f in fields(SessionStats)}, "document every SessionStats counter"


class NodeCollector(Collector):
    """Collects a daemon's node, session and queue metrics."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterable[Metric]:
        d = self.daemon
        info = InfoMetricFamily("rollart_node", "The node's identity", labels=["node", "role", "hardware"])
        info.add_metric([d.spec.name, d.role.value, d.spec.hardware], {})
        yield info
        yield GaugeMetricFamily("rollart_node_uptime_seconds", "Seconds since the node started", value=d.uptime_s())
        yield GaugeMetricFamily("rollart_node_paused", "1 while the node is paused", value=float(d.paused))
        yield GaugeMetricFamily("rollart_node_draining", "1 while the node is draining", value=float(d.draining))
        yield GaugeMetricFamily("rollart_node_in_flight_requests", "Requests being served", value=d.in_flight())
        tasks = len(asyncio.all_tasks())
        yield GaugeMetricFamily("rollart_node_asyncio_tasks", "Tasks alive on the node's event loop", value=tasks)
        queues = GaugeMetricFamily("rollart_node_queue_depth", "Items waiting in the role's queues", labels=["queue"])
        for name, depth in d.queue_depths().items():
            queues.add_metric([name], depth)
        yield queues
        if (version := d.policy_version()) is not None:
            yield GaugeMetricFamily("rollart_node_policy_version", "Policy version the node works at", value=version)
        if (busy := d.busy_fraction()) is not None:
            yield GaugeMetricFamily("rollart_node_busy_ratio", "How busy the role's main resource is, 0-1", value=busy)
        for name, (doc, value) in d.role_gauges().items():
            yield GaugeMetricFamily(name, doc, value=value)
        for name, (doc, label, values) in d.role_labelled_gauges().items():
            family = GaugeMetricFamily(name, doc, labels=[label])
            for key, value in values.items():
                family.add_metric([key], value)
            yield family
        for name, (doc, value) in d.role_counters().items():
            yield CounterMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "rollart_handshake_refusals", "Incoming connections refused at the handshake", value=d.server.refusals
        )
        yield from _session_metrics(
            [("out", s) for s in d.clients.values()] + [("in", s) for s in d.server.sessions.values()]
        )


def _session_metrics(sessions: list[tuple[str, Session]]) -> Iterator[Metric]:
    labels = ["peer", "direction"]
    up = GaugeMetricFamily("rollart_session_up", "1 while the session has a live connection", labels=labels)
    unacked = GaugeMetricFamily("rollart_session_unacked", "Messages in the resend buffer", labels=labels)
    pending = GaugeMetricFamily("rollart_session_pending_requests", "Requests awaiting a response", labels=labels)
    counters = {
        name: CounterMetricFamily(f"rollart_session_{name}", doc, labels=labels)
        for name, doc in _SESSION_COUNTERS.items()
    }
    for direction, session in sessions:
        key = [session.peer.node if session.peer else "?", direction]
        described = session.describe()
        up.add_metric(key, float(described["state"] == "up"))
        unacked.add_metric(key, described["unacked"])
        pending.add_metric(key, described["pending_requests"])
        for name, family in counters.items():
            family.add_metric(key, getattr(session.stats, name))
    yield from (up, unacked, pending, *counters.values())


def node_registry(daemon: NodeDaemon) -> CollectorRegistry:
    """A registry of its own per node (several nodes may share a process in tests)."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(daemon))
    ProcessCollector(registry=registry)
    return registry
