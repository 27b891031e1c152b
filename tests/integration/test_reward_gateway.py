"""The reward gateway as a real process: the pool scales with load and back to its minimum."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollart.protocol import ClientSession, Identity, SessionConfig, tcp_connector
from rollart.protocol.errors import RemoteError
from rollart.protocol.messages import APP, Score, Scored
from tests.support import healthy, http, start_node, wait_for, write_topology

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
async def test_reward_pool_scales_up_under_load_and_back_to_min_when_idle(tmp_path: Path) -> None:
    topology, ports = write_topology(
        tmp_path,
        {"reward": "reward-gateway", "env-0": "env-host"},  # env-0: this test's client (not started)
        extra_run="  reward_pool: {min_workers: 0, max_workers: 2, idle_timeout_s: 1.0}\n",
    )
    proc = start_node(topology, "reward", tmp_path / "reward.log")
    port, admin = ports["reward"]
    try:
        await asyncio.to_thread(wait_for, lambda: healthy(admin), 30, "reward gateway healthy")
        assert http("GET", admin, "/status")[1]["reward_pool"]["live_workers"] == 0  # scaled to zero
        cfg = SessionConfig()
        client = ClientSession(
            lambda: tcp_connector("127.0.0.1", port, cfg),
            secret=b"test-secret",
            local=Identity("env-0", "env-host"),
            channel=APP,
            cfg=cfg,
            peer_name="reward",
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.run())
            requests = [
                Score("exact-answer", "reverse", "p", f"\\boxed{{abc{i}}}", answer=f"abc{i}") for i in range(12)
            ]
            replies = await asyncio.gather(*(client.request(r, timeout=30) for r in requests))
            assert all(isinstance(r, Scored) and r.reward == 1.0 for r in replies)

            with pytest.raises(RemoteError) as unknown:
                await client.request(Score("exact-anwser", "t", "p", "r", answer="a"), timeout=10)
            assert unknown.value.code == "bad-request" and "exact-answer" in unknown.value.message
            with pytest.raises(RemoteError) as missing:
                await client.request(Score("exact-answer", "t", "p", "\\boxed{a}"), timeout=10)
            assert missing.value.code == "bad-request" and "answer" in missing.value.message

            pool = http("GET", admin, "/status")[1]["reward_pool"]
            assert pool["peak_workers"] == 2 and pool["cold_starts"]["count"] >= 1 and pool["served"] == 12

            def back_to_zero() -> bool:
                return http("GET", admin, "/status")[1]["reward_pool"]["live_workers"] == 0

            await asyncio.to_thread(wait_for, back_to_zero, 20, "the pool to retire its idle workers")
            _, text = http("GET", admin, "/metrics")
            metrics = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
            assert metrics["rollart_reward_workers"] == 0 and metrics["rollart_reward_cold_starts"] >= 1
            assert metrics["rollart_reward_cold_start_last_seconds"] > 0
            await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
