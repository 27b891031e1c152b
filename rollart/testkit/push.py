"""One weight push the way a run makes it, in one process: a `WeightPublisher` sends a version over loopback TCP
to a `SessionServer` whose bulk connections a `WeightReceiver` serves, which hands it to `apply` (an engine's
`load_weights`, or a test's). For tests and benchmarks that measure or check a push without starting nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch

from rollart.protocol import CONTROL, Identity, Session, SessionConfig, SessionServer
from rollart.testkit.ports import free_ports
from rollart.weights.config import WeightsSpec
from rollart.weights.publisher import WeightPublisher
from rollart.weights.receiver import ApplyWeights, ReceiverStats, WeightReceiver

HOST = "127.0.0.1"
SECRET = b"loopback weight push"
GENERATOR = Identity("gen-0", "generator")
TRAINER = Identity("trainer", "trainer")
CFG = SessionConfig(handshake_timeout_s=10.0, backoff_base_s=0.05, backoff_cap_s=0.5)


@dataclasses.dataclass(frozen=True)
class Pushed:
    """What the receiver counted, and the push's wall time (publish to acknowledgement)."""

    stats: ReceiverStats
    seconds: float


class _NoMessages:
    """The receiving server's message handler: weight pushes come on bulk connections only."""

    async def on_event(self, session: Session, msg: Any) -> None:
        raise RuntimeError(f"unexpected event {msg!r}")

    async def on_request(self, session: Session, msg: Any) -> Any:
        raise RuntimeError(f"unexpected request {msg!r}")


async def push_once(
    apply: ApplyWeights,
    version: int,
    weights: Mapping[str, torch.Tensor],
    *,
    holding: int = 0,
    dtype: torch.dtype | None = None,
    owned: bool = False,
    shared: bool = False,
    timeout: float = 60.0,
) -> Pushed:
    """Publish `weights` as `version` (in `dtype`, None: as they are) to a receiver holding `holding` (receiving
    into shared memory when `shared`, as a vLLM generator's does), and wait for its acknowledgement, which comes
    after `apply` returned. TimeoutError names the publisher's last error."""
    (port,) = free_ports(1)
    receiver = WeightReceiver(apply, version=holding, dtype=dtype, shared=shared)
    server = SessionServer(
        local=GENERATOR, secret=SECRET, channel=CONTROL, handler=_NoMessages(), cfg=CFG, on_bulk=receiver.on_bulk
    )
    publisher = WeightPublisher(TRAINER, SECRET, CFG, WeightsSpec(transport="tcp"))
    async with asyncio.timeout(timeout + 30), asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        await server.listen_tcp(HOST, port)
        publisher.add_target(GENERATOR.node, HOST, port, dtype=dtype)
        tg.create_task(publisher.run())
        began = time.perf_counter()
        try:
            publisher.publish(version, weights, owned=owned)
            await publisher.wait_delivered(version, timeout=timeout)
            took = time.perf_counter() - began
        except TimeoutError:
            error = publisher.stats()[GENERATOR.node].last_error
            raise TimeoutError(f"version {version} not acknowledged in {timeout:.0f} s; last error: {error}") from None
        finally:
            await publisher.close()
            await receiver.close()
            await server.close()
    return Pushed(receiver.stats(), took)
