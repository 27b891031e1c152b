"""Several engines per generator node (`run.generator.engines`): real HF engines on the tiny model behind one
`EngineSet`: trajectories stick to their engine, new ones go to the least loaded, weights reach every engine, and
the node's devices are cut into one slice per engine."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rollart.generation.engine import InvalidRequest, SamplingParams
from rollart.generation.engine_set import EngineSet, slices
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from rollart.nodes.generator import build_engines
from rollart.topology import parse_topology
from tests.engine_reference import PROMPTS, build_engine_test_model, noisy_weights

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("engine-set") / "model")


@pytest.fixture
async def engines(model_dir: Path) -> AsyncIterator[EngineSet]:
    engine_set = EngineSet([HFEngine(model_dir, max_batch_size=8) for _ in range(2)])
    await engine_set.start()
    yield engine_set
    await engine_set.close()


def greedy(tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0)


async def test_a_trajectory_stays_on_its_engine_and_new_ones_spread(engines: EngineSet, model_dir: Path) -> None:
    _, tokenizer = load_model_and_tokenizer(model_dir)
    prompt = tokenizer.encode(PROMPTS[0])
    # Two trajectories start together: one on each engine.
    await asyncio.gather(*(engines.generate(f"t{i}.0", prompt, greedy(), key=f"t{i}") for i in range(2)))
    assert sorted(engines._by_key.values()) == [0, 1]
    first = engines._by_key["t0"]
    # t0's next turns return to its engine even while the other engine is idle and its own is busy.
    busy = asyncio.create_task(engines.generate("t9.0", prompt, greedy(24), key="t9"))
    await asyncio.sleep(0)
    await engines.generate("t0.1", prompt, greedy(), key="t0")
    assert engines._by_key["t0"] == first
    await busy
    served = [engine.load().generated_tokens for engine in engines.engines]
    assert all(tokens > 0 for tokens in served), served


async def test_weights_reach_every_engine(engines: EngineSet, model_dir: Path) -> None:
    _, tokenizer = load_model_and_tokenizer(model_dir)
    prompt = tokenizer.encode(PROMPTS[1])
    model, _ = load_model_and_tokenizer(model_dir)
    await engines.load_weights(3, noisy_weights(model, seed=2, scale=0.1))
    results = await asyncio.gather(
        *(engine.generate(f"r{i}", prompt, greedy()) for i, engine in enumerate(engines.engines))
    )
    assert results[0].token_ids == results[1].token_ids
    assert all(set(r.versions) == {3} for r in results)
    assert engines.load().version == 3


def test_devices_are_cut_into_one_slice_per_engine() -> None:
    assert slices(["0", "1", "2", "3"], 2, what="GPUs") == [["0", "1"], ["2", "3"]]
    assert slices([0, 1], 2, what="cores") == [[0], [1]]
    with pytest.raises(InvalidRequest, match="3 GPUs cannot be split evenly into 2 engines"):
        slices(["0", "1", "2"], 2, what="GPUs")


def test_a_node_builds_its_engines_from_the_topology(model_dir: Path) -> None:
    topology = parse_topology(
        f"run:\n  model: {{path: {model_dir}}}\n  generator: {{backend: hf, engines: 2, max_num_seqs: 4}}\n"
        "nodes:\n  - {name: gen-0, role: generator, port: 9001, admin_port: 9002}\n"
    )
    built = build_engines(topology.run, "cpu", dtype="float32", on_gpu=False)
    assert [type(engine) for engine in built.engines] == [HFEngine, HFEngine]
    assert all(engine._max_batch_size == 4 and engine._device.type == "cpu" for engine in built.engines)  # type: ignore[attr-defined]


def test_generator_settings_are_checked_with_their_yaml_path() -> None:
    from rollart.errors import ConfigError

    bad = (
        ("{backend: hf, tensor_parallel_size: 2}", "run.generator.tensor_parallel_size: only the vllm backend"),
        ("{gpu_memory_utilization: 1.5}", "run.generator.gpu_memory_utilization: expected a value in (0, 1]"),
        ("{engines: 0}", "run.generator.engines: expected an integer >= 1"),
        ("{max_model_len: 0}", "run.generator.max_model_len: expected an integer >= 1 or null"),
        ("{device: tpu}", "run.generator.device: expected auto, cpu, cuda or cuda:N"),
        ("{backend: sim, engines: 2}", "run.generator.engines: the sim backend models its replicas"),
    )
    node = "nodes:\n  - {name: g, role: generator, port: 9001, admin_port: 9002}\n"
    for generator, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_topology(f"run:\n  generator: {generator}\n{node}")
