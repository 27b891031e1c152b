"""Two vLLM engines in one generator node (`run.generator.engines: 2`), as `build_engines` makes them from the
topology: each bound to its own share of the node's cores, new trajectories spread over both, a weight version
loaded into both (greedy output then equal on each, and changed).

Needs vLLM: `bin/setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_engines.py -q`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollart import cpus
from rollart.generation.engine import SamplingParams
from rollart.generation.vllm.engine import VLLMEngine
from rollart.models.loading import load_model_and_tokenizer
from rollart.nodes.generator import build_engines
from rollart.topology import parse_topology
from tests.engine_reference import noisy_weights
from tests.slow.vllm_marks import vllm_engine_marks

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(360)


async def test_two_vllm_engines_per_node_share_its_cores_requests_and_weights(
    qwen3_bpe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpus.ENV, "0-1")  # the launcher's share of the machine for this node: both cores
    topology = parse_topology(
        f"run:\n  model: {{path: {qwen3_bpe_dir}}}\n"
        "  generator: {backend: vllm, engines: 2, max_num_seqs: 8, max_model_len: 512}\n"
        "nodes:\n  - {name: gen-0, role: generator, port: 9001, admin_port: 9002}\n"
    )
    engines = build_engines(topology.run, "cpu", dtype="bfloat16", on_gpu=False)
    assert [type(e) for e in engines.engines] == [VLLMEngine, VLLMEngine]
    assert [e._settings.cpu_threads_bind for e in engines.engines] == ["0", "1"]  # type: ignore[attr-defined]
    await engines.start()
    try:
        _, tokenizer = load_model_and_tokenizer(qwen3_bpe_dir)
        prompt = tokenizer.encode("Repeat this letter 12 times: R")
        greedy = SamplingParams(max_tokens=12, temperature=0.0)

        async def each() -> list[list[int]]:
            results = [await engine.generate(f"r{i}", prompt, greedy) for i, engine in enumerate(engines.engines)]
            return [r.token_ids for r in results]

        before = await each()
        assert before[0] == before[1]
        await asyncio.gather(*(engines.generate(f"t{i}.0", prompt, greedy, key=f"t{i}") for i in range(4)))
        assert sorted(engines._by_key.values()) == [0, 0, 1, 1]  # new trajectories go to the least loaded
        model, _ = load_model_and_tokenizer(qwen3_bpe_dir, dtype=torch.float32)
        await engines.load_weights(
            1, {k: v.to(torch.bfloat16) for k, v in noisy_weights(model, seed=3, scale=0.5).items()}
        )
        after = await each()
        assert after[0] == after[1] and after != before
        assert engines.load().version == 1
    finally:
        await engines.close()
