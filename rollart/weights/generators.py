"""Which generators the trainer pushes weights to, where, and in which dtype: the publisher's targets, kept in
line with what the generators say.

Before the first push the trainer asks every generator where to push (`WeightsWhere`: its UCX port, the dtype
its engines run in, the version it holds) and adds it as a target of the `WeightPublisher`; the newest version
any of them holds is what the trainer's weights must be numbered above. Before each push it reads what the
generators last reported in their status: a restarted generator listens for UCX on a new port (the target
moves) and may hold an older version than it acknowledged (it gets the latest again).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from rollart.errors import RollartError
from rollart.protocol.messages import NodeStatus, WeightsWhere
from rollart.protocol.retry import Backoff, retry
from rollart.weights.buckets import wire_dtype

if TYPE_CHECKING:
    import torch

    from rollart.protocol import ClientSession
    from rollart.weights.publisher import WeightPublisher

log = structlog.get_logger("rollart.weights.publisher")


@dataclass(frozen=True)
class GeneratorAddress:
    """A generator node as the weight push reaches it."""

    name: str
    host: str
    port: int
    """Its session port: TCP bulk connections go there."""
    place: str
    """`cluster/host`: relay chains are ordered by it, so a bucket crosses between clusters once."""


class GeneratorTargets:
    """The publisher's targets, one per generator (module docstring)."""

    def __init__(
        self,
        publisher: WeightPublisher,
        generators: Sequence[GeneratorAddress],
        clients: Mapping[str, ClientSession],
        peer_status: Mapping[str, NodeStatus],
    ) -> None:
        """`clients` has a session to each of `generators`; `peer_status` is the live map of the status peers
        last reported."""
        self.publisher = publisher
        self._generators = {generator.name: generator for generator in generators}
        self._clients, self._peer_status = clients, peer_status
        self._ucx_ports: dict[str, int] = {}
        self._dtypes: dict[str, torch.dtype | None] = {}

    async def connect(self) -> int:
        """Ask every generator where to push weights (and in which dtype), and add it as a target; returns the
        newest version any of them holds."""
        held = 0
        for name, generator in self._generators.items():
            client = self._clients[name]
            here = await retry(
                functools.partial(client.request, WeightsWhere(), timeout=client.cfg.probe_timeout_s),
                what=f"the weights address of generator {name}",
                retry_on=(RollartError,),
                backoff=Backoff.for_retries(client.cfg),
                deadline_s=client.cfg.retry_deadline_s,
            )
            self._dtypes[name] = wire_dtype(here.dtype, what=f"generator {name}'s weights")
            self._add(generator, here.ucx_port)
            held = max(held, here.version)
        return held

    def wire_dtype(self) -> torch.dtype | None:
        """The dtype every generator takes its weights in, to cast to in the export (None: they differ, or
        none said; the publisher casts per target)."""
        dtypes = set(self._dtypes.values())
        return dtypes.pop() if len(dtypes) == 1 else None

    def follow(self) -> None:
        """Follow what the generators last reported: a restarted one's new UCX port, and the version it holds."""
        for name, status in self._peer_status.items():
            if name not in self._ucx_ports or not isinstance(status, NodeStatus) or "ucx_port" not in status.load:
                continue
            port = int(status.load["ucx_port"])
            if port != self._ucx_ports[name]:
                self.publisher.remove_target(name)
                self._add(self._generators[name], port)
                log.info("weights.generator_moved", generator=name, ucx_port=port)
            if "version" in status.load:
                self.publisher.report_holding(name, int(status.load["version"]))

    def _add(self, generator: GeneratorAddress, ucx_port: int) -> None:
        self.publisher.add_target(
            generator.name,
            generator.host,
            generator.port,
            ucx_port=ucx_port or None,
            dtype=self._dtypes.get(generator.name),
            place=generator.place,
        )
        self._ucx_ports[generator.name] = ucx_port
