"""The tiny default model: its tokenizer, a deterministic build, and the one loading path."""

from __future__ import annotations

import hashlib
import json
import string
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from rollart.models.loading import load_model_and_tokenizer
from rollart.tiny.model import (
    MARKER_FILE,
    TinySizes,
    build_tiny_model,
    build_tokenizer,
    ensure_tiny_model,
    main,
)

torch.set_num_threads(1)

SMALL = TinySizes(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
"""A smaller model where only the build itself is under test."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def weights_hash(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_tokenizer_gives_one_token_per_character_and_round_trips() -> None:
    tokenizer = build_tokenizer()
    text = "Hello, World!\n  x = [1, 2]; {a: 'b'} ~`@#$%^&*()_+-=|\\<>?/\"\n"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    printable = string.ascii_letters + string.digits + string.punctuation + " \n"
    assert tokenizer.decode(tokenizer.encode(printable)) == printable
    assert 100 <= len(tokenizer) <= 110


def test_tokenizer_keeps_special_tokens_atomic_and_maps_unknowns() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("a<|im_end|>b<|endoftext|>")
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "<|im_end|>", "b", "<|endoftext|>"]
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("é\t")) == ["<|unk|>", "<|unk|>"]


def test_chat_template_is_qwen_style() -> None:
    tokenizer = build_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|im_start|>assistant\n"


def test_build_saves_a_hugging_face_folder(tiny_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILE):
        assert (tiny_dir / name).is_file(), name
    marker = json.loads((tiny_dir / MARKER_FILE).read_text())
    assert marker["seed"] == 0
    assert marker["vocab_size"] == len(build_tokenizer())
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True


def test_a_larger_vocabulary_and_an_untied_head(tmp_path: Path) -> None:
    """What the trainer benchmark builds: Qwen3's vocabulary size, an output head of its own."""
    sizes = TinySizes(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=1000)
    out = build_tiny_model(tmp_path / "wide", sizes=msgspec.structs.replace(sizes, tie_word_embeddings=False))
    model, tokenizer = load_model_and_tokenizer(out)
    assert model.config.vocab_size == 1000 and len(tokenizer) < 1000
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["vocab_size"] == 1000 and marker["tie_word_embeddings"] is False
    assert marker["parameters"] == sum(p.numel() for p in model.parameters())


def test_build_is_deterministic_per_seed(tiny_dir: Path, tmp_path: Path) -> None:
    same = build_tiny_model(tmp_path / "same", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert weights_hash(same) == weights_hash(tiny_dir)
    assert weights_hash(other) != weights_hash(tiny_dir)


def test_reload_gives_identical_logits(tiny_dir: Path) -> None:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    fresh = Qwen3ForCausalLM.from_pretrained(str(tiny_dir)).eval()  # independent of the loader under test
    model, tokenizer = load_model_and_tokenizer(tiny_dir)
    assert not model.training
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    assert tokenizer.decode(ids[0].tolist()) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == (
        "<|im_start|>user\nx<|im_end|>\n"
    )


def test_ensure_builds_once_and_leaves_an_existing_model(tmp_path: Path) -> None:
    path = tmp_path / "models" / "tiny"
    assert ensure_tiny_model(path, seed=3) == path
    first = weights_hash(path)
    (path / "model.safetensors").touch()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(path, seed=4)  # already there: not rebuilt, whatever the seed
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert weights_hash(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]  # no staging folders left behind


def test_ensure_is_safe_when_racing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollart.tiny import model as tiny_model

    path = tmp_path / "tiny"
    barrier = threading.Barrier(3)
    real_build = tiny_model.build_tiny_model

    def build_in_step(out_dir: Path, *, seed: int = 0) -> Path:
        real_build(out_dir, seed=seed, sizes=SMALL)
        barrier.wait(timeout=10)  # every builder has finished before any renames
        return out_dir

    monkeypatch.setattr(tiny_model, "build_tiny_model", build_in_step)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            ensure_tiny_model(path, seed=0)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert (path / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_cli_prints_what_it_built(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-model"
    main(["--out", str(out), "--seed", "2"])  # what `python -m rollart.tiny.model` runs
    printed = capsys.readouterr().out
    assert "parameters" in printed and "vocab 101" in printed and str(out) in printed
    assert json.loads((out / MARKER_FILE).read_text())["seed"] == 2


def test_rollart_build_model_command_builds_a_loadable_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollart.cli import main as rollart

    out = tmp_path / "built"
    assert rollart(["build-model", str(out), "--seed", "4"]) == 0
    assert str(out) in capsys.readouterr().out
    model, tokenizer = load_model_and_tokenizer(out)
    assert json.loads((out / MARKER_FILE).read_text())["seed"] == 4
    assert model.config.vocab_size == len(tokenizer)
