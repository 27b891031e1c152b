"""The daemon base in one process over loopback TCP: drain finishes in-flight work, refuses new work."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import structlog

from rollart.nodes.generator import GeneratorNode
from rollart.nodes.trainer import TrainerNode
from rollart.protocol import Session
from rollart.protocol.errors import RemoteError
from rollart.protocol.messages import Echo, Notice
from rollart.testkit.topology import TopologyBuilder


class SlowGenerator(GeneratorNode):
    """A generator whose role request (a Notice, for the test) takes until released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def on_role_request(self, session: Session, msg: Any) -> Any:
        self.started.set()
        await self.release.wait()
        return Echo(7)


def topology(tmp_path: Path) -> Any:
    return TopologyBuilder(tmp_path, drain_timeout_s=5).node("trainer", "trainer").node("gen-0", "generator").topology()


async def test_drain_finishes_in_flight_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    gen = SlowGenerator(topo, topo.node("gen-0"), secret=b"s", admin_token="t")
    trainer = TrainerNode(topo, topo.node("trainer"), secret=b"s", admin_token="t")
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        gen_run = tg.create_task(gen.run())
        trainer_run = tg.create_task(trainer.run())
        session = trainer.clients["gen-0"]
        await session.up.wait()
        in_flight = asyncio.ensure_future(session.request(Notice("slow"), timeout=10))
        await gen.started.wait()
        gen.request_drain("test")
        assert gen.status()["state"] == "draining"
        with pytest.raises(RemoteError) as refused:
            await session.request(Notice("new"), timeout=5)
        assert refused.value.code == "draining"
        assert not gen_run.done()  # still waiting for the in-flight request
        gen.release.set()
        assert await in_flight == Echo(7)
        await gen_run  # the generator exits once in-flight work is done
        status = trainer.status()
        assert status["sessions"]["outgoing"][0]["peer"] == "gen-0"
        trainer.request_drain("test")
        await trainer_run


async def test_unknown_requests_get_a_clear_error(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    gen = GeneratorNode(topo, topo.node("gen-0"), secret=b"s", admin_token="t")
    trainer = TrainerNode(topo, topo.node("trainer"), secret=b"s", admin_token="t")
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        tg.create_task(gen.run())
        tg.create_task(trainer.run())
        session = trainer.clients["gen-0"]
        await session.up.wait()
        assert await session.request(Echo(3, b"x"), timeout=5) == Echo(3, b"x")
        with pytest.raises(RemoteError) as refused:
            await session.request(Notice("?"), timeout=5)
        assert refused.value.code == "unknown-request"
        assert "a generator does not serve Notice requests" in str(refused.value)
        with structlog.testing.capture_logs() as logs:
            await session.send(Echo(5))  # an event a generator does not expect: logged, nothing breaks
            assert await session.request(Echo(6), timeout=5) == Echo(6)
        assert {"event": "node.unexpected_event", "message": "Echo", "peer": "trainer", "log_level": "warning"} in logs
        gen.request_drain("test")
        trainer.request_drain("test")
