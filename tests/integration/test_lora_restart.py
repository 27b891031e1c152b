"""A generator node under LoRA (`run.trainer.lora`) killed and started again: it loads the base from
`run.model.path`, the publisher gives it the newest adapters whole, and its greedy output is then the base with
those adapters merged (by PEFT), not with the earlier version's as well. One real generator node process; the test
plays the trainer with a real `WeightPublisher` over loopback TCP and the env-host with a session of its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollart.lora.spec import LoraSpec
from rollart.models.loading import load_model_and_tokenizer
from rollart.protocol import Identity, SessionConfig
from rollart.protocol.messages import Generate, Generated
from rollart.weights.config import WeightsSpec
from rollart.weights.publisher import WeightPublisher
from tests.engine_reference import PROMPTS, build_engine_test_model, hf_greedy
from tests.integration.cluster import SECRET, Cluster, make_cluster, training_yaml
from tests.lora_reference import peft_adapters
from tests.support import node_client

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

MAX_TOKENS = 12
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj"])
LORA = "lora: {rank: 4, alpha: 8.0, target_modules: [q_proj, v_proj, o_proj]}"


async def greedy(port: int, prompts: list[list[int]], tag: str) -> list[Generated]:
    """Greedy replies of the generator node on `port`, through a session of an env-host's."""
    client = node_client(port, "gen-0")
    replies = []
    async with asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        for i, prompt in enumerate(prompts):
            reply = await client.request(Generate(f"{tag}-{i}", f"{tag}-{i}", prompt, MAX_TOKENS, 0.0), timeout=60)
            assert isinstance(reply, Generated)
            replies.append(reply)
        await client.close()
    return replies


def engine_ready(cluster: Cluster, version: int) -> None:
    def ready(status: dict[str, object]) -> bool:
        engine = status["engine"]
        assert isinstance(engine, dict)
        return bool(engine["ready"]) and engine["weights"]["version"] == version

    cluster.wait_status("gen-0", ready, 90, f"gen-0 ready at version {version}")


@pytest.mark.timeout(150)
async def test_lora_a_restarted_generator_serves_the_base_from_disk_with_the_newest_adapters(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    model_dir = build_engine_test_model(tmp_path / "model")
    _, tokenizer = load_model_and_tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS[:3]]
    first, merged_1 = peft_adapters(model_dir, SPEC, seed=1, scale=0.3)
    second, merged_2 = peft_adapters(model_dir, SPEC, seed=2, scale=0.3)
    cluster = make_cluster(
        clusters,
        tmp_path,
        training_yaml(model_dir, steps=1, trainer=LORA),
        # trainer and env-0: this test's publisher and client, named in the topology (not started)
        nodes={"gen-0": "generator", "trainer": "trainer", "env-0": "env-host"},
    )
    cluster.start("gen-0")
    await asyncio.to_thread(engine_ready, cluster, 0)
    assert cluster.status("gen-0")["engine"]["lora"] is True
    port = cluster.ports["gen-0"][0]
    publisher = WeightPublisher(Identity("trainer", "trainer"), SECRET, SessionConfig(), WeightsSpec(transport="tcp"))
    publisher.add_target("gen-0", "127.0.0.1", port)
    async with asyncio.timeout(120), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        publisher.publish(1, first)
        await publisher.wait_delivered(1, timeout=30)
        on_first = await greedy(port, prompts, "v1")
        publisher.publish(2, second)
        await publisher.wait_delivered(2, timeout=30)

        await asyncio.to_thread(cluster.kill, "gen-0")
        cluster.start("gen-0", log_as="gen-0-restarted")
        # The publisher sees the new process hold nothing and pushes it the newest version, whole.
        await asyncio.to_thread(engine_ready, cluster, 2)
        after_restart = await greedy(port, prompts, "v2")
        await publisher.close()

    assert [r.token_ids for r in on_first] == [hf_greedy(merged_1, p, MAX_TOKENS) for p in prompts]
    assert [r.token_ids for r in after_restart] == [hf_greedy(merged_2, p, MAX_TOKENS) for p in prompts]
    assert all(r.versions == [2] * MAX_TOKENS for r in after_restart), after_restart
    weights = cluster.status("gen-0")["engine"]["weights"]
    assert weights["applied"] == 1 and weights["deltas"] == 0, weights  # the restarted process: one whole version
