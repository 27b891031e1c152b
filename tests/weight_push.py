"""One weight push the way a run makes it: a `WeightPublisher` sends a version over loopback TCP to a
`SessionServer` whose bulk connections a `WeightReceiver` serves, which hands it to an engine's `load_weights`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from rollart.protocol import CONTROL, Identity, Session, SessionConfig, SessionServer
from rollart.testkit.ports import free_ports
from rollart.weights import ApplyWeights, ReceiverStats, WeightPublisher, WeightReceiver

HOST = "127.0.0.1"
SECRET = b"weight push test secret"
GENERATOR = Identity("gen-0", "generator")
TRAINER = Identity("trainer", "trainer")
CFG = SessionConfig(handshake_timeout_s=5.0, backoff_base_s=0.05, backoff_cap_s=0.3)


class _NoMessages:
    async def on_event(self, session: Session, msg: Any) -> None:
        raise AssertionError(f"unexpected event {msg!r}")

    async def on_request(self, session: Session, msg: Any) -> Any:
        raise AssertionError(f"unexpected request {msg!r}")


async def push_over_tcp(
    apply: ApplyWeights, version: int, weights: Mapping[str, torch.Tensor], *, holding: int = 0, timeout: float = 60
) -> ReceiverStats:
    """Publish `weights` as `version` to a receiver holding `holding` whose `apply` is given; return the receiver's
    stats once the publisher has the acknowledgement (after `apply` returned)."""
    (port,) = free_ports(1)
    receiver = WeightReceiver(apply, version=holding)
    server = SessionServer(
        local=GENERATOR, secret=SECRET, channel=CONTROL, handler=_NoMessages(), cfg=CFG, on_bulk=receiver.on_bulk
    )
    publisher = WeightPublisher(TRAINER, SECRET, CFG, transport="tcp")
    async with asyncio.timeout(timeout + 10), asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        await server.listen_tcp(HOST, port)
        publisher.add_target(GENERATOR.node, HOST, port)
        tg.create_task(publisher.run())
        publisher.publish(version, weights)
        try:
            await publisher.wait_delivered(version, timeout=timeout)
        except TimeoutError:
            error = publisher.stats()[GENERATOR.node].last_error
            raise AssertionError(f"version {version} not delivered in {timeout} s; last error: {error}") from None
        finally:
            await publisher.close()
            await receiver.close()
            await server.close()
    return receiver.stats()
