"""The mismatch monitor: each step measures the generators' log-probs against the trainer's on the tokens the
trainer's own weights generated (zero staleness), and warns, naming the generators, when they disagree.

A real transformers engine samples from the trainer's weights and a real torch training engine takes a step on what
it sampled: KL about 0, ratios 1. Then the engine is given a version whose two layers' MLP weights are swapped, as a
wrong name mapping in a weight sync would do (the push's checks pass: every byte arrives as sent), and the same
step's `mismatch_kl` passes the warning threshold; the learner's warning names the generator that served them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from rollart.algorithms.grpo import pack_batch
from rollart.generation.engine import SamplingParams
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from rollart.nodes.learner import Learner, name_sources
from rollart.rundir import RunDir
from rollart.testkit.batches import Seq
from rollart.training.registry import build_training_engine
from rollart.training.spec import TrainerSpec
from tests.engine_reference import build_engine_test_model, encoded_prompts, generate_all

pytestmark = pytest.mark.integration

SWAPPED = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight")


async def sampled(engine: HFEngine, model_dir: Path, tag: str) -> list[Seq]:
    prompts = [p for p in encoded_prompts(model_dir) for _ in range(4)]
    results = await generate_all(engine, prompts, tag, SamplingParams(max_tokens=8, temperature=1.0))
    return [
        Seq(prompt, r.token_ids, [1] * len(r.token_ids), r.logprobs, r.versions)
        for prompt, r in zip(prompts, results, strict=True)
    ]


def learner(tmp_path: Path) -> Learner:
    none: Any = None  # the monitor needs neither an engine builder nor a publisher
    return Learner(TrainerSpec(), run_dir=RunDir(tmp_path), targets=SimpleNamespace(publisher=None), build_engine=none)


async def test_mismatch_monitor_sees_weights_that_differ_and_names_the_generator(tmp_path: Path) -> None:
    model_dir = build_engine_test_model(tmp_path / "model")
    model, _ = load_model_and_tokenizer(model_dir)
    weights = {name: t.clone() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    swapped = dict(weights) | {SWAPPED[0]: weights[SWAPPED[1]], SWAPPED[1]: weights[SWAPPED[0]]}
    engine = HFEngine(model_dir, max_batch_size=32)
    await engine.start()
    try:
        healthy = await sampled(engine, model_dir, "h")  # version 0: the trainer's own weights
        await engine.load_weights(1, swapped)  # what a push with a wrong name mapping would load
        broken = await sampled(engine, model_dir, "b")
    finally:
        await engine.close()
    assert {v for s in broken for v in s.versions} == {1}

    trainer = build_training_engine(TrainerSpec(backend="torch", lr=0.0, threads=1), model_dir, seed=0)
    try:
        fine = trainer.train_step(pack_batch(healthy, [1.0, -1.0] * 10, pad_id=0), version=0)
        wrong = trainer.train_step(pack_batch(broken, [1.0, -1.0] * 10, pad_id=0), version=1)
    finally:
        trainer.close()
    print(
        f"healthy: KL {fine['mismatch_kl']:.2e}, ratio max {fine['mismatch_ratio_max']:.5f}; "
        f"swapped: KL {wrong['mismatch_kl']:.3f}, ratio max {wrong['mismatch_ratio_max']:.2f}"
    )
    assert fine["mismatch_frac"] == 1.0  # every token came from the weights the step starts from
    assert fine["mismatch_kl"] < 1e-6 and abs(fine["mismatch_ratio_max"] - 1) < 1e-3, fine
    assert wrong["mismatch_kl"] > TrainerSpec().mismatch_warn_kl, wrong

    # One batch of both, every token of the step's version: the monitor tells the two generators apart.
    both = [dataclasses.replace(s, versions=[2] * len(s.versions), generators=["gen-good"]) for s in healthy]
    both += [dataclasses.replace(s, versions=[2] * len(s.versions), generators=["gen-bad"]) for s in broken]
    names = ["gen-bad", "gen-good"]
    trainer = build_training_engine(TrainerSpec(backend="torch", lr=0.0, threads=1), model_dir, seed=0)
    try:
        mixed = name_sources(
            trainer.train_step(pack_batch(both, [1.0, -1.0] * 20, pad_id=0, generators=names), version=2), names
        )
    finally:
        trainer.close()
    by = {name: mixed[f"mismatch_kl/{name}"] for name in names}
    assert by["gen-good"] < 1e-6 and by["gen-bad"] > 0.02, by
    assert mixed["mismatch_kl"] == pytest.approx((by["gen-good"] + by["gen-bad"]) / 2, rel=0.2)  # equal halves, about

    watcher = learner(tmp_path)
    served = [
        SimpleNamespace(versions=[2], generators=["gen-good"]),
        SimpleNamespace(versions=[2], generators=["gen-bad"]),
    ]
    with capture_logs() as logs:
        watcher._watch_mismatch(fine, served, 2)  # below the threshold: quiet
        watcher._watch_mismatch(mixed, served, 2)
        watcher._watch_mismatch(wrong, [*served, SimpleNamespace(versions=[0], generators=["gen-old"])], 1)
        diluted = {"mismatch_kl": 0.01, "mismatch_kl/gen-bad": 0.5, "mismatch_kl/gen-good": 0.0}  # 1 bad of 50
        watcher._watch_mismatch(diluted, served, 2)
    named, unattributed, one_of_many = [line for line in logs if line["event"] == "trainer.mismatch"]
    assert one_of_many["generators"] == ["gen-bad"], one_of_many  # the batch's KL is under the threshold; its isn't
    assert named["generators"] == ["gen-bad"], named  # its tokens alone: the good one is not named
    assert unattributed["generators"] == [], unattributed  # no token of version 1 in these stand-ins' versions


def test_mismatch_monitor_counts_only_tokens_of_the_steps_own_version() -> None:
    from rollart.algorithms.config import GRPOConfig
    from rollart.algorithms.grpo import grpo_loss

    seqs = [Seq([5, 6], [7, 8, 9], [1, 1, 1], [-1.0, -2.0, -3.0], [4, 3, 4])]
    batch = pack_batch(seqs, [1.0], pad_id=0)
    prox = torch.tensor([[0.0, 0.0, -1.0, -2.5, -3.0]])  # token 8 (version 3) differs, the others agree
    _, stats = grpo_loss(prox.clone(), prox, batch, GRPOConfig(), total_tokens=3, version=4)
    means = stats.means()
    assert (means["mismatch_frac"] * 3, means["mismatch_kl"], means["mismatch_ratio_max"]) == (2.0, 0.0, 1.0)
    _, stats = grpo_loss(prox.clone(), prox, batch, GRPOConfig(), total_tokens=3, version=3)
    d = torch.tensor(-0.5)
    assert stats.means()["mismatch_kl"] == pytest.approx(float(d.exp() - d - 1))
    _, stats = grpo_loss(prox.clone(), prox, batch, GRPOConfig(), total_tokens=3)
    assert stats.means() == stats.means() | {"mismatch_frac": 0.0} and "mismatch_kl" not in stats.means()
