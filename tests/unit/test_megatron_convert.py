"""Tests of the Hugging Face <-> Megatron-Core weight conversion (`rollart.training.megatron.convert`).

Small Qwen3 (tied embeddings, q/k norms, head_dim != hidden/heads), Qwen2 (q/k/v biases, untied)
and Llama (one key/value head, so tp=2 splits a query group) models with random weights go to
Megatron shards and back bit for bit, for tp=1, 2 and pp=1, 2, and a tp=2 checkpoint reshards to
tp=1. The Megatron side is checked against a real `GPTModel` built on CPU (a gloo world of one):
its state dict's names and shapes, a strict `load_state_dict`, and its logits against HF's. The
forward runs on CPU with two stand-ins for CUDA-only code (module `megatron_forward_on_cpu`).

Run: pytest tests/unit/test_megatron_convert.py (every test's name holds `megatron_convert`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rollart.errors import ConfigError
from rollart.training.megatron.convert import (
    Architecture,
    Parallel,
    architecture,
    check_parallel,
    gpt_model_kwargs,
    megatron_to_hf,
    padded_vocab_size,
    to_megatron,
    transformer_config_kwargs,
)

SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "max_position_embeddings": 128}
CONFIGS: dict[str, dict[str, Any]] = {
    # vocab 200: Megatron pads it to 256 (x tp); head_dim 32 != 64 / 4
    "qwen3": {
        "model_type": "qwen3",
        **SHAPE,
        "vocab_size": 200,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        "model_type": "qwen2",
        **SHAPE,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    # one key/value head: with tp=2 each rank holds half of the one query group's rows
    "llama": {
        "model_type": "llama",
        **SHAPE,
        "vocab_size": 130,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
    },
}


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(CONFIGS[family])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, rope_theta=50000.0, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor tell its rows apart
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def shards_of(hf: dict[str, torch.Tensor], arch: Architecture, parallel: Parallel) -> dict[tuple[int, int], Any]:
    return {
        (r, s): to_megatron(hf, arch, parallel, tp_rank=r, stage=s)
        for r in range(parallel.tp)
        for s in range(parallel.pp)
    }


def assert_same_state(got: list[tuple[str, torch.Tensor]], want: dict[str, torch.Tensor]) -> None:
    assert [name for name, _ in got] == list(want)  # HF's own order
    for name, tensor in got:
        assert tensor.shape == want[name].shape, name
        assert torch.equal(tensor, want[name]), name
        assert tensor.is_contiguous(), name


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_convert_round_trip_is_exact(family: str, tp: int, pp: int) -> None:
    model = hf_model(family)
    arch = architecture(model.config)
    parallel = Parallel(tp=tp, pp=pp)
    assert check_parallel(arch, parallel) == []
    hf = model.state_dict()
    shards = shards_of(hf, arch, parallel)
    assert_same_state(list(megatron_to_hf(shards, arch, parallel)), hf)
    if arch.tied_embeddings:
        assert torch.equal(
            dict(megatron_to_hf(shards, arch, parallel))["lm_head.weight"], hf["model.embed_tokens.weight"]
        )


def test_megatron_convert_shards_layout() -> None:
    """Names per stage (layers numbered from 0 in each), vocab padding, the tied copy on the last stage,
    and the fused tensors' layout: per query group its q heads, its k head, its v head; fc1 per rank
    [gate shard; up shard]."""
    model = hf_model("qwen3")
    arch = architecture(model.config)
    hf = model.state_dict()
    parallel = Parallel(tp=2, pp=2)
    shards = shards_of(hf, arch, parallel)
    first, last = shards[0, 0], shards[1, 1]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" not in first and "decoder.layers.2.input_layernorm.weight" not in first
    assert "embedding.word_embeddings.weight" not in last and "decoder.final_layernorm.weight" in last
    # layer 3 is the second layer of stage 1
    assert torch.equal(last["decoder.layers.1.input_layernorm.weight"], hf["model.layers.3.input_layernorm.weight"])
    padded = padded_vocab_size(200, parallel)
    assert padded == 256
    embedding = shards[1, 0]["embedding.word_embeddings.weight"]
    assert embedding.shape == (padded // 2, 64)
    assert torch.equal(embedding[: 200 - 128], hf["model.embed_tokens.weight"][128:])
    assert not embedding[200 - 128 :].any()  # padding rows
    assert torch.equal(last["output_layer.weight"], embedding)  # Megatron's copy of the tied embedding

    qkv = shards[1, 0]["decoder.layers.0.self_attention.linear_qkv.weight"]  # rank 1: query group 1
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    head = arch.head_dim
    assert torch.equal(qkv[: 2 * head], q[2 * head : 4 * head])
    assert torch.equal(qkv[2 * head : 3 * head], k[head:])
    assert torch.equal(qkv[3 * head :], v[head:])
    fc1 = shards[1, 0]["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[48:], up[48:]]))
    proj = shards[1, 0]["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, 64:])


def test_megatron_convert_transformer_engine_names() -> None:
    model = hf_model("qwen2")
    arch = architecture(model.config)
    parallel = Parallel(spec="te")
    shard = to_megatron(model.state_dict(), arch, parallel, tp_rank=0, stage=0)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shard
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shard
    assert "decoder.layers.0.input_layernorm.weight" not in shard
    assert_same_state(list(megatron_to_hf({(0, 0): shard}, arch, parallel)), model.state_dict())


def test_megatron_convert_reshards_tp2_to_tp1() -> None:
    """A tp=2 x pp=2 checkpoint, merged to HF and split again at tp=1 x pp=1, equals a direct tp=1 conversion."""
    model = hf_model("qwen2")
    arch = architecture(model.config)
    hf = model.state_dict()
    two = shards_of(hf, arch, Parallel(tp=2, pp=2))
    merged = dict(megatron_to_hf(two, arch, Parallel(tp=2, pp=2)))
    again = to_megatron(merged, arch, Parallel(), tp_rank=0, stage=0)
    direct = to_megatron(hf, arch, Parallel(), tp_rank=0, stage=0)
    assert again.keys() == direct.keys()
    for name, tensor in direct.items():
        assert torch.equal(again[name], tensor), name


def test_megatron_convert_reads_architectures() -> None:
    qwen3 = architecture(hf_model("qwen3").config)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.tied_embeddings, qwen3.head_dim) == (True, False, True, 32)
    assert qwen3.rope_theta == 50000.0
    qwen2 = architecture(hf_model("qwen2").config)
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.tied_embeddings, qwen2.head_dim) == (False, True, False, 16)
    kwargs = transformer_config_kwargs(qwen2)
    assert kwargs["kv_channels"] == 16 and kwargs["add_qkv_bias"] and not kwargs["qk_layernorm"]
    assert kwargs["hidden_dropout"] == kwargs["attention_dropout"] == 0.0
    # an older config.json: rope_theta at the top level
    old = {**CONFIGS["llama"], "rope_theta": 500000.0, "rope_scaling": None, "hidden_act": "silu"}
    assert architecture(old).rope_theta == 500000.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2'"),
        ({"num_experts": 8}, "mixture of experts"),
        ({"use_sliding_window": True}, "sliding-window attention"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_megatron_convert_refuses_what_it_cannot_convert(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        architecture({**CONFIGS["llama"], **change})


def test_megatron_convert_checks_parallel_sizes() -> None:
    arch = architecture(CONFIGS["qwen2"])  # 4 heads, 2 key/value heads, 4 layers, MLP 96
    assert check_parallel(arch, Parallel(tp=4, pp=4)) == []
    problems = dict(check_parallel(arch, Parallel(tp=3, pp=3)))
    assert "4 attention heads" in problems["tensor_parallel"]
    assert "4 layers" in problems["pipeline_parallel"]


# -- against a real GPTModel, on CPU ------------------------------------------------------------------


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Megatron warns on import that Transformer Engine and Apex are absent (pytest makes warnings errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """A torch.distributed world of one (gloo, in-process store) with Megatron's parallel state tp=pp=1;
    torn down afterwards so nothing else sees it."""
    import torch.distributed as dist

    with quiet():
        from megatron.core import parallel_state
    if dist.is_initialized():
        pytest.fail("a torch.distributed process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def gpt_model(arch: Architecture, **config: Any) -> torch.nn.Module:
    with quiet():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            **transformer_config_kwargs(arch),
            use_cpu_initialization=True,
            perform_initialization=False,
            params_dtype=torch.float32,
            **config,
        )
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        model: torch.nn.Module = GPTModel(config, spec, **gpt_model_kwargs(arch, Parallel()))
    return model.eval()


@pytest.fixture
def megatron_forward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-Core 0.16's forward moves RoPE's inverse frequencies to `torch.cuda.current_device()`
    and forks the CUDA RNG tracker around attention (a no-op without dropout); these stand in for both."""
    with quiet():
        from megatron.core import tensor_parallel

    class NoTracker:
        def fork(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *args, **kwargs: NoTracker())


def tensor_names(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in state.items() if not name.endswith("._extra_state")}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_megatron_convert_matches_a_real_gpt_model(megatron_world: None, family: str) -> None:
    model = hf_model(family)
    arch = architecture(model.config)
    megatron = gpt_model(arch)
    converted = to_megatron(model.state_dict(), arch, Parallel(), tp_rank=0, stage=0)
    assert tensor_names(converted) == tensor_names(megatron.state_dict())
    megatron.load_state_dict(converted, strict=True)  # `_extra_state` entries may be left out
    loaded = megatron.state_dict()
    for name, tensor in converted.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_megatron_convert_gives_hf_logits(megatron_world: None, megatron_forward_on_cpu: None, family: str) -> None:
    """The converted GPTModel computes HF's logits (on the real vocabulary; padded rows are extra)."""
    model = hf_model(family)
    arch = architecture(model.config)
    megatron = gpt_model(arch)
    state = to_megatron(model.state_dict(), arch, Parallel(), tp_rank=0, stage=0)
    megatron.load_state_dict(state, strict=True)
    ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12)[None].expand(2, 12)
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    with torch.no_grad(), quiet():
        logits = megatron(ids, positions, causal)
        want = model(input_ids=ids).logits
    assert logits.shape == (2, 12, padded_vocab_size(arch.vocab_size, Parallel()))
    torch.testing.assert_close(logits[..., : arch.vocab_size], want, rtol=1e-4, atol=1e-4)


# -- the engine's step and its refusals, on CPU ------------------------------------------------------


class Unwrapped(torch.nn.Module):
    """What `MegatronStep` needs of Megatron's DistributedDataParallel, around a bare GPTModel (one rank)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.config = module.config

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad(set_to_none=True)


class ClippedAdamW:
    """Megatron's optimizer interface (`step` -> (ok, grad norm, zeros)) over torch's AdamW, clipped as
    the torch backend clips."""

    def __init__(self, params: Any, clip: float, lr: float) -> None:
        self.params = list(params)
        self.clip = clip
        self.adam = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def step(self) -> tuple[bool, torch.Tensor, None]:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.adam.step()
        return True, norm, None


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["t1", "temperature_logprobs"])
def test_megatron_convert_step_matches_the_torch_backend(
    megatron_world: None,
    megatron_forward_on_cpu: None,
    monkeypatch: pytest.MonkeyPatch,
    tiny_model: Any,
    temperature: float,
) -> None:
    """`MegatronStep` (the megatron backend's step: Megatron's schedule, vocab-parallel log-probs, the
    per-token loss) on a real GPTModel gives the torch backend's statistics over two steps. Megatron's
    DDP and distributed optimizer need CUDA; here `finalize_model_grads`' division by the loss tokens
    is done by hand, and the schedule's one CUDA tensor goes to the CPU."""
    import json
    import types

    from rollart.testkit.batches import synthetic_batch
    from rollart.training.megatron.rank import HFWeights
    from rollart.training.megatron.step import MegatronStep
    from rollart.training.spec import TrainerSpec
    from rollart.training.step import World
    from rollart.training.torch.engine import TorchTrainer

    with quiet():
        from megatron.core.pipeline_parallel import schedules

    class CpuTorch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
            return torch.zeros(*args, **{**kwargs, "device": "cpu"})

    monkeypatch.setattr(schedules, "torch", CpuTorch("torch"))
    arch = architecture(json.loads((tiny_model / "config.json").read_text()))
    megatron = gpt_model(arch, calculate_per_token_loss=True)
    megatron.load_state_dict(to_megatron(HFWeights(tiny_model), arch, Parallel(), tp_rank=0, stage=0))

    def finalize(models: list[Any], num_tokens: torch.Tensor | None, **kwargs: Any) -> None:
        assert num_tokens is not None
        for param in megatron.parameters():
            if param.grad is not None:
                param.grad /= num_tokens

    megatron.config.finalize_model_grads_func = finalize
    spec = TrainerSpec(micro_batch_size=2, precision="fp32", lr=1e-3)
    step = MegatronStep(
        Unwrapped(megatron),
        ClippedAdamW(megatron.parameters(), spec.grad_clip, spec.lr),
        spec,
        vocab_size=arch.vocab_size,
        tp_rank=0,
        last_stage=True,
        replicas=World(),
        device=torch.device("cpu"),
    )
    reference = TorchTrainer(tiny_model, spec, seed=0)
    batch = synthetic_batch(temperature)  # at 0.7 both divide the logits by it (Megatron: `token_logprobs`)
    for _ in range(2):
        with quiet():
            got = step.train_step(batch, version=3)
        want = reference.train_step(batch, version=3)
        keys = ("loss", "policy_loss", "importance_ratio_mean", "truncated_frac", "clipped_frac", "grad_norm")
        for key in (*keys, "mismatch_kl", "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_frac"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_megatron_convert_engine_refuses_a_machine_without_cuda(tiny_model: Any) -> None:
    from rollart.training.registry import build_training_engine
    from rollart.training.spec import TrainerSpec

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"megatron backend needs CUDA GPUs.*conversion is tested on CPU"):
        build_training_engine(TrainerSpec(backend="megatron"), tiny_model, seed=0)


def test_megatron_convert_engine_checks_the_split(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tensor_parallel must divide ranks (topology validation); tp x pp the group's ranks, and the model's
    heads and layers (at build time, named as run.trainer fields)."""
    from rollart.training.megatron.engine import check_megatron
    from rollart.training.registry import check
    from rollart.training.spec import RankLayout, TrainerSpec

    problems = dict(check(TrainerSpec(backend="megatron", ranks=4, tensor_parallel=3)))
    assert "must divide run.trainer.ranks" in problems["tensor_parallel"]
    assert check(TrainerSpec(backend="megatron", ranks=4, tensor_parallel=2, pipeline_parallel=2)) == []
    assert (
        "only the megatron backend" in dict(check(TrainerSpec(backend="fsdp2", tensor_parallel=2)))["tensor_parallel"]
    )
    # past the CUDA check, as on a GPU machine with 8 devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    spec = TrainerSpec(backend="megatron", ranks=8, tensor_parallel=8, pipeline_parallel=1)
    with pytest.raises(ConfigError, match=r"run\.trainer\.tensor_parallel: 8 must divide the 4 attention heads"):
        check_megatron(spec, tiny_model, RankLayout(world_size=8, local_ranks=8))
    spec = TrainerSpec(backend="megatron", ranks=6, tensor_parallel=2, pipeline_parallel=3)
    with pytest.raises(ConfigError, match=r"run\.trainer\.pipeline_parallel: 3 does not divide the 4 layers"):
        check_megatron(spec, tiny_model, RankLayout(world_size=6, local_ranks=6))
    spec = TrainerSpec(backend="megatron", ranks=6, tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(ConfigError, match=r"run\.trainer\.pipeline_parallel: .* = 4 must divide the group's 6"):
        check_megatron(spec, tiny_model, RankLayout(world_size=6, local_ranks=6))
    check_megatron(
        TrainerSpec(backend="megatron", ranks=4, tensor_parallel=2, pipeline_parallel=2),
        tiny_model,
        RankLayout(world_size=4, local_ranks=4),
    )
