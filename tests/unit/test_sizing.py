"""Model shapes and presets (`rollart.models`), the memory estimates (`rollart.topology.sizing`, `fit`) and
`rollart check TOPOLOGY`'s table and verdicts, on the hardware a topology declares: no GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.cli import main
from rollart.errors import ConfigError
from rollart.models.presets import PRESETS, preset
from rollart.models.shapes import ModelShape, read_shape, shape_from_config
from rollart.topology import parse_topology
from rollart.topology.fit import size_topology

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3

# The model cards' figures: (parameters, non-embedding parameters), billions.
PUBLIC_SIZES = {
    "qwen3-0.6b": (0.6, 0.44),
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2),
    "qwen3-32b": (32.8, 31.2),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_SIZES))
def test_presets_parameter_counts_are_within_2_percent_of_the_public_sizes(name: str) -> None:
    shape = PRESETS[name]
    total, body = PUBLIC_SIZES[name]
    assert shape.params() / 1e9 == pytest.approx(total, rel=0.02)
    assert (shape.params() - shape.embedding_params()) / 1e9 == pytest.approx(body, rel=0.02)


def test_exact_counts_and_kv_bytes_by_hand() -> None:
    shape = PRESETS["qwen3-8b"]
    # per layer: q 4096x4096, k and v 4096x1024 each, o 4096x4096, q/k norms 2x128, MLP 3x4096x12288, 2 norms
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 256 + 3 * 4096 * 12288 + 2 * 4096
    assert shape.params() == 36 * layer + 2 * 151936 * 4096 + 4096 == 8_190_735_360
    assert shape.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2 == 147456
    assert shape.kv_bytes_per_token(tensor_parallel=2) == 73728
    assert shape.kv_bytes_per_token(tensor_parallel=16) == 2 * 36 * 1 * 128 * 2  # a KV head per GPU at least
    assert preset("Qwen3-8B") is shape


def _qwen3_06b_config(**changes: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
    return {**config, **changes}


def test_a_config_json_reads_as_its_shape_with_either_dtype_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_qwen3_06b_config()))
    shape = read_shape(tmp_path)
    assert shape == ModelShape(**{**vars(PRESETS["qwen3-0.6b"]), "name": str(tmp_path)})
    five = _qwen3_06b_config(dtype="bfloat16")  # transformers 5 writes `dtype`
    del five["torch_dtype"]
    assert shape_from_config(five).dtype == "bfloat16"
    assert shape_from_config({**five, "dtype": None}).dtype == "float32"  # none named: float32
    qwen25 = {  # Qwen2.5-0.5B: biases on q, k and v, no head_dim key; the card says 0.49B
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
    }
    assert shape_from_config(qwen25).params() == 494_032_768


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


GENERATOR_32B = """
run:
  model: {{path: models/Qwen3-32B, build_tiny_if_missing: false, shape: qwen3-32b}}
  generator: {{backend: vllm, tensor_parallel_size: {tp}, max_model_len: 40960}}
  rollout: {{mode: train, tasks: [{{name: t, env: frozen-lake}}]}}
nodes:
  - {{name: env-0, role: env-host, port: 7100, admin_port: 7200}}
  - {{name: gen-0, role: generator, port: 7101, admin_port: 7201, resources: {{gpus: {tp}, gpu_type: A100-40G}}}}
"""


def test_a_generator_that_cannot_fit_is_refused_naming_its_yaml_path_and_fits_after_more_tensor_parallel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, GENERATOR_32B.format(tp=1))
    assert main(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"rollart: {path}: nodes[1].resources.gpus: generator gen-0 needs 73.5 GiB per GPU for weights (61.0), "
        "activations (2.5) and one 40960-token sequence (10.0); its A100-40G holds 40.0 x 0.90 = 36.0 GiB usable: "
        "try tensor_parallel_size: 4 (19.4 GiB per GPU; the node then needs engines x 4 = 4 GPUs), or a GPU with "
        "more memory\n"
    )
    row = next(line.split() for line in out.splitlines() if line.startswith("gen-0"))
    cells = ["gen-0", "generator", "127.0.0.1", "0", "A100-40G", "40.0", "GPU", "61.0", "-", "2.5", "10.0", "73.5"]
    assert row == [*cells, "40.0", "x", "0.90", "=", "36.0", "NO", "FIT"]
    assert main(["check", str(_write(tmp_path, GENERATOR_32B.format(tp=4)))]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("gen-0"))
    assert row[3:12] == ["0-3", "A100-40G", "40.0", "GPU", "15.3", "-", "1.6", "2.5", "19.4"] and row[-1] == "ok"


def test_a_trainer_that_cannot_fit_gets_concrete_suggestions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    topology = parse_topology(
        """
run:
  model: {path: models/none, shape: qwen3-8b}
  trainer: {backend: torch, micro_batch_tokens: 8192}
  rollout: {mode: train, tasks: [{name: t, env: frozen-lake}]}
nodes:
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 1, gpu_type: H100}}
  - {name: cpu-trainer-peer, role: env-host, port: 7101, admin_port: 7201, resources: {memory_gb: 4}}
"""
    )
    sizing = size_topology(topology)
    [(path, problem)] = sizing.problems
    assert path == "nodes[0].resources.gpus"
    assert problem.startswith("trainer trainer needs ")
    assert "its H100 holds 79.6 x 0.90 = 71.7 GiB usable: try activation_checkpointing: true" in problem
    assert (
        "backend fsdp2 with 2 ranks in the group (65.8 GiB per GPU with activation checkpointing)" in problem
        and "master_dtype: bf16" in problem
    )
    trainer = sizing.nodes[0]
    assert trainer.weights == 8_190_735_360 * 4 and trainer.grads_optim == 8_190_735_360 * 12
    assert sizing.nodes[1].verdict == "-" and sizing.nodes[1].notes == ["holds no policy model"]


def test_cpu_nodes_are_sized_against_memory_gb_when_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = """
run:
  model: {path: models/none, shape: qwen3-0.6b}
  generator: {backend: hf}
  rollout: {mode: train, tasks: [{name: t, env: frozen-lake}]}
nodes:
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200%s}
  - {name: gen, role: generator, port: 7101, admin_port: 7201, resources: {memory_gb: 64}}
"""
    unsized = size_topology(parse_topology(text % ""))
    assert unsized.nodes[0].verdict == "-" and unsized.nodes[0].per == "node" and unsized.problems == []
    assert unsized.nodes[1].verdict == "ok"
    small = size_topology(parse_topology(text % ", resources: {memory_gb: 8}"))
    assert small.problems[0][0] == "nodes[0].resources.memory_gb"
    assert "it is given 8 (memory_gb) GiB" in small.problems[0][1]


def test_a_checkpoints_config_json_wins_over_the_shape_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(_qwen3_06b_config()))
    topology = parse_topology(
        "run: {model: {path: m, shape: qwen3-32b}}\nnodes: [{name: t, role: trainer, port: 7100, admin_port: 7200}]\n"
    )
    sizing = size_topology(topology)
    assert sizing.source == "m/config.json" and sizing.shape is not None and sizing.shape.layers == 28


def test_an_unknown_shape_preset_is_refused_with_the_known_names() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_topology(
            "run: {model: {shape: qwen3-8}}\nnodes: [{name: t, role: trainer, port: 7100, admin_port: 7200}]"
        )
    assert str(refused.value) == (
        "<string>: run.model.shape: unknown model shape 'qwen3-8' (known: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, "
        "qwen3-14b, qwen3-32b); did you mean 'qwen3-8b'?"
    )


def test_the_gpu_configs_pass_check_and_two_clusters_writes_an_sbatch_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no models/ here: both are sized by run.model.shape
    assert main(["check", str(ROOT / "configs" / "gpu-node.yaml")]) == 0
    out = capsys.readouterr().out
    assert "trainer  trainer         127.0.0.1  0-3 H100 79.6  GPU  8.3      22.9       8.4" in out
    assert "gen-1    generator       127.0.0.1  6-7 H100 79.6  GPU  7.6" in out
    assert out.rstrip().endswith("gpu-node.yaml: ok, 5 nodes")
    assert main(["check", str(ROOT / "configs" / "two-clusters.yaml")]) == 0
    out = capsys.readouterr().out
    assert "trainer-b  trainer         10.0.0.2  0-7 H800 79.6  GPU  9.4" in out
    assert "gen-3      generator       10.1.0.4  0-7 H20 95.6   GPU  30.5" in out
    script = tmp_path / "job.sbatch"
    assert main(["slurm", str(ROOT / "configs" / "two-clusters.yaml"), "--out", str(script)]) == 0
    text = script.read_text()
    assert "# component 0: trainer (2 nodes of one trainer group)" in text and text.count("--gpus-per-task=8") == 2


def test_check_shows_the_weight_path_its_bytes_route_memory_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(ROOT / "configs" / "gpu-node.yaml")]) == 0
    out = capsys.readouterr().out
    version = PRESETS["qwen3-8b"].weight_bytes("bfloat16")
    assert f"weights: a version is {version / 1e9:.2f} GB (bfloat16, the generators' dtype)" in out
    seconds = version * 8 / 16e9  # loopback TCP on one host
    assert f"trainer -> gen-0  same host (127.0.0.1), 16 Gb/s (loopback TCP): ~{seconds:.1f} s" in out
    assert "gen-0 -> gen-1    same host (127.0.0.1), 16 Gb/s (loopback TCP): pipelined behind the hop before" in out
    assert f"each generator's host {2 * version / 1e9:.1f} GB of receive buffers" in out
    # between hosts: the slower side's network_gbps, or an assumed 10 Gb/s that says so
    topology = (ROOT / "configs" / "two-clusters.yaml").read_text()
    assert main(["check", str(ROOT / "configs" / "two-clusters.yaml")]) == 0
    assert "10 Gb/s assumed: set resources.network_gbps" in capsys.readouterr().out
    faster = tmp_path / "fast.yaml"
    faster.write_text(topology.replace("resources: {", "resources: {network_gbps: 400, "))
    assert main(["check", str(faster)]) == 0
    out = capsys.readouterr().out
    assert "trainer -> gen-0  10.0.0.1 -> 10.1.0.1, 400 Gb/s: ~1.3 s" in out and "assumed" not in out


@pytest.mark.parametrize("name", ["local.yaml", "local-fsdp2.yaml", "sim-paper.yaml"])
def test_the_existing_configs_still_pass_check(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(ROOT / "configs" / name)]) == 0


def test_megatron_splits_weights_over_model_parallel_and_the_optimizer_over_data_parallel_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    topology = parse_topology(
        """
run:
  model: {path: models/none, shape: qwen3-8b}
  trainer: {backend: megatron, ranks: 4, tensor_parallel: 2, micro_batch_tokens: 4096, activation_checkpointing: true}
  rollout: {mode: train, tasks: [{name: t, env: frozen-lake}]}
nodes:
  - {name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {gpus: 4, gpu_type: H100}}
"""
    )
    [trainer] = size_topology(topology).nodes
    params = 8_190_735_360
    # bf16 weights over tp 2; fp32 gradients over tp 2; fp32 master + 2 moments over tp 2 x dp 2
    assert trainer.weights == params * 2 / 2
    assert trainer.grads_optim == params * 4 / 2 + params * 12 / 4
    assert trainer.verdict == "ok" and "megatron tp 2 x pp 1 x dp 2, optimizer sharded over dp" in trainer.notes[0]


@pytest.mark.parametrize(("tokens", "fits"), [(16384, False), (4096, True)])
def test_megatron_counts_its_unfused_attention_and_whole_logits_as_measured_on_an_h200(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokens: int, fits: bool
) -> None:
    """benchmarks/results/gpu/README.md: the megatron backend on one H200 (Qwen3-1.7B shape, bf16, rows of
    up to 1,024 tokens) ran out of memory at 16,384 tokens a micro-batch and trained at 4,096."""
    monkeypatch.chdir(tmp_path)
    topology = parse_topology(
        f"""
run:
  model: {{path: models/none, shape: qwen3-1.7b}}
  trainer: {{backend: megatron, precision: bf16, micro_batch_tokens: {tokens}}}
  rollout: {{mode: train, tasks: [{{name: t, env: frozen-lake, max_total_tokens: 1024}}]}}
nodes:
  - {{name: trainer, role: trainer, port: 7100, admin_port: 7200, resources: {{gpus: 1, gpu_type: H200}}}}
"""
    )
    [trainer] = size_topology(topology).nodes
    assert (trainer.verdict == "ok") is fits, (trainer.need, trainer.usable, trainer.problem)
    if not fits:
        assert trainer.problem is not None and "a smaller micro-batch" in trainer.problem[1]


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json (the sizing keys), as published
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}

MOE_TOPOLOGY = """
run:
  model: {path: m, build_tiny_if_missing: false}
  generator: {backend: vllm, tensor_parallel_size: 2, max_model_len: 8192}
  rollout: {mode: train, tasks: [{name: t, env: frozen-lake}]}
nodes:
  - {name: env-0, role: env-host, port: 7100, admin_port: 7200}
  - {name: gen-0, role: generator, port: 7101, admin_port: 7201, resources: {gpus: 2, gpu_type: H100}}
"""


def test_moe_qwen3_30b_a3b_is_sized_as_30_5b_parameters_with_3_3b_active(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = shape_from_config(QWEN3_30B_A3B)
    assert (shape.experts, shape.experts_per_token, shape.sparse_layers) == (128, 8, 48)
    assert round(shape.params() / 1e9, 2) == 30.53 and round(shape.active_params() / 1e9, 2) == 3.35
    assert shape.active_intermediate == 8 * 768  # what a token's MLP activations scale with, not 6144
    dense = shape_from_config({**QWEN3_30B_A3B, "num_experts": 0})
    assert dense.params() == dense.active_params() and round(dense.params() / 1e9, 1) == 3.3  # as read before
    every_other = shape_from_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert every_other.sparse_layers == 23  # layers 2, 4, ..., 48 (1-based) have experts; 1 (0-based) is dense
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert main(["check", str(_write(tmp_path, MOE_TOPOLOGY))]) == 0
    assert "30.53B parameters (3.35B active: 8 of 128 experts)" in capsys.readouterr().out
