"""The BPE test model (rollart/models/qwen3_bpe.py): loads as a Qwen3 checkpoint does, and behaves like one.

Built once per session (the `qwen3_bpe_dir` fixture, a few seconds) and once more through the CLI, which
doubles as the determinism check. Everything is loaded the way users load real checkpoints: `AutoTokenizer`
and `AutoModelForCausalLM` from the folder, `local_files_only`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rollart.cli import build_parser
from rollart.cli import main as cli_main
from rollart.models.qwen3_bpe import (
    ADDED_TOKENS,
    DEFAULT_SIZES,
    MARKER_FILE,
    PRETOKENIZE_REGEX,
    QWEN3_CHAT_TEMPLATE,
    Qwen3BpeSizes,
    build_qwen3_bpe_model,
    train_tokenizer,
)
from rollart.tasks import CopyReverseEnv, FrozenLakeEnv, SokobanEnv

TEMPLATE_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
"""Qwen3's chat template, byte for byte (see the module docstring of qwen3_bpe.py for where it came from)."""
BPE = DEFAULT_SIZES.bpe_vocab_size
IM_START, IM_END, ENDOFTEXT = BPE + 1, BPE + 2, BPE
SMALL = Qwen3BpeSizes(bpe_vocab_size=1000, corpus_documents=500)
"""A small tokenizer for the tests where only training itself is under test."""


@pytest.fixture(scope="module")
def tokenizer(qwen3_bpe_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(qwen3_bpe_dir, local_files_only=True)


@pytest.fixture(scope="module")
def cli_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """A second build, with the same seed, through `rollart build-model --preset qwen3-bpe`: (folder, exit code,
    what it printed)."""
    out, printed = tmp_path_factory.mktemp("cli") / "qwen3-bpe", io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli_main(["build-model", str(out), "--preset", "qwen3-bpe", "--seed", "0"])
    return out, code, printed.getvalue()


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def test_qwen3_bpe_model_has_real_qwen3_shape_in_bfloat16(qwen3_bpe_dir: Path, tokenizer: Any) -> None:
    config = json.loads((qwen3_bpe_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["bos_token_id"] == ENDOFTEXT and config["eos_token_id"] == IM_END
    # More embedding rows than tokens, as Qwen3 has (151,936 for 151,669).
    assert config["vocab_size"] % 128 == 0 and config["vocab_size"] > len(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(qwen3_bpe_dir, local_files_only=True)
    assert model.dtype == torch.bfloat16  # dtype="auto" is the default: the checkpoint's own
    parameters = sum(p.numel() for p in model.parameters())
    assert 20e6 <= parameters <= 50e6
    marker = json.loads((qwen3_bpe_dir / MARKER_FILE).read_text())
    assert marker["preset"] == "qwen3-bpe" and marker["seed"] == 0 and marker["parameters"] == parameters


def test_qwen3_bpe_model_untied_has_an_output_layer_of_its_own(tmp_path: Path) -> None:
    sizes = msgspec.structs.replace(SMALL, hidden_size=64, num_layers=1, intermediate_size=128, tie_embeddings=False)
    folder = build_qwen3_bpe_model(tmp_path / "untied", sizes=sizes)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embedding.data_ptr() != head.data_ptr() and not torch.equal(embedding, head)
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["tie_embeddings"] is False and marker["parameters"] == sum(p.numel() for p in model.parameters())


def test_qwen3_bpe_tokenizer_has_qwen3_added_tokens_and_roles(tokenizer: Any) -> None:
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"  # what AutoTokenizer gives for Qwen3 checkpoints
    assert len(tokenizer) == BPE + len(ADDED_TOKENS) == 8026
    for i, (token, special) in enumerate(ADDED_TOKENS):
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False)[1:-1] == [BPE + i], token
        assert tokenizer.added_tokens_decoder[BPE + i].special is special, token
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", IM_END)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", ENDOFTEXT)
    assert tokenizer.bos_token is None and tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    # `<think>` and `<tool_call>` are plain added tokens (special=false), as in Qwen3: decoding keeps them.
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nx</think><tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx</think><tool_call>"


def test_qwen3_bpe_tokenizer_json_is_laid_out_as_qwen3s(qwen3_bpe_dir: Path, tokenizer: Any) -> None:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_REGEX

    spec = json.loads((qwen3_bpe_dir / "tokenizer.json").read_text())
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == PRETOKENIZE_REGEX == QWEN2_REGEX and split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and not byte_level["add_prefix_space"] and not byte_level["use_regex"]
    assert spec["decoder"]["type"] == "ByteLevel" and spec["model"]["type"] == "BPE"
    assert [a["id"] for a in spec["added_tokens"]] == list(range(BPE, BPE + len(ADDED_TOKENS)))
    assert tokenizer.tokenize("x = 12345") == ["x", "Ġ=", "Ġ", "1", "2", "3", "4", "5"]  # digits one by one


def test_qwen3_bpe_tokenizer_covers_the_built_in_tasks(tokenizer: Any) -> None:
    """The corpus restates the tasks' texts; their real prompts and observations must come out as compact
    (a character-level tokenizer gives 1 character a token, byte-level BPE on foreign text about 1.3)."""
    chars = tokens = 0
    for env in (FrozenLakeEnv(), SokobanEnv(), CopyReverseEnv(), FrozenLakeEnv(compact=True, position=True)):
        observation, _ = env.reset(seed=3)
        for text in (observation, env.system_prompt):
            ids = tokenizer.encode(text)
            assert len(text) / len(ids) >= 2.0, (type(env).__name__, text)
            chars, tokens = chars + len(text), tokens + len(ids)
    assert chars / tokens >= 3.0


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60))
def test_qwen3_bpe_round_trips_any_unicode_text(tokenizer: Any, text: str) -> None:
    assume(unicodedata.is_normalized("NFC", text))  # Qwen's NFC normalizer rewrites the rest, as Qwen3's does
    assume(not any(token in text for token, _ in ADDED_TOKENS))
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < BPE for i in ids)


@pytest.mark.parametrize(
    "text",
    [
        "Emoji 🙂🚀👩‍👩‍👧 ✅, CJK 数学题, Hangul 한국어, RTL שלום, combining é (NFC)",
        "  leading, trailing  \t\ttabs\r\n\r\nCRLF\n\n\n   \n",
        "\x00\x01\x7f control bytes \u200b zero width \ufeff BOM \U0010fffd plane 16",
        '\\boxed{42} {"name": "move", "arguments": {"direction": "left"}}',
    ],
)
def test_qwen3_bpe_round_trips_unicode_and_whitespace(qwen3_bpe_dir: Path, tokenizer: Any, text: str) -> None:
    from tokenizers import Tokenizer

    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # A server that reads tokenizer.json itself (vLLM's fast path) sees the same ids.
    assert Tokenizer.from_file(str(qwen3_bpe_dir / "tokenizer.json")).encode(text).ids == ids


def test_qwen3_bpe_chat_template_is_qwen3s_verbatim(tokenizer: Any) -> None:
    assert hashlib.sha256(QWEN3_CHAT_TEMPLATE.encode()).hexdigest() == TEMPLATE_SHA256
    assert tokenizer.chat_template == QWEN3_CHAT_TEMPLATE
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tokenizer, question, add_generation_prompt=True) == prompt
    assert render(tokenizer, question, add_generation_prompt=True, enable_thinking=True) == prompt
    no_thinking = render(tokenizer, question, add_generation_prompt=True, enable_thinking=False)
    assert no_thinking == prompt + "<think>\n\n</think>\n\n"
    ids = tokenizer.encode(no_thinking)
    assert ids[0] == IM_START and ids.count(IM_END) == 2 and tokenizer.convert_tokens_to_ids("</think>") in ids


def test_qwen3_bpe_chat_template_drops_thinking_before_the_last_user_turn(tokenizer: Any) -> None:
    first = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."}
    conversation = [{"role": "user", "content": "What is 2+2?"}, first, {"role": "user", "content": "And 3+3?"}]
    last = {"role": "assistant", "content": "<think>\nadd again\n</think>\n\nIt is 6."}
    expected = (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    )
    assert render(tokenizer, conversation, add_generation_prompt=True) == expected + "<|im_start|>assistant\n"
    after = "<|im_start|>assistant\n<think>\nadd again\n</think>\n\nIt is 6.<|im_end|>\n"
    assert render(tokenizer, [*conversation, last]) == expected + after
    # The same thinking given as `reasoning_content` renders the same way.
    structured = {"role": "assistant", "content": "It is 6.", "reasoning_content": "add again"}
    assert render(tokenizer, [*conversation, structured]) == expected + after


def test_qwen3_bpe_chat_template_renders_tools_and_tool_responses(tokenizer: Any) -> None:
    tool = {"type": "function", "function": {"name": "move", "parameters": {"type": "object", "properties": {}}}}
    call = {"type": "function", "function": {"name": "move", "arguments": {"direction": "left"}}}
    messages = [
        {"role": "user", "content": "Go left."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "You moved left."},
    ]
    text = render(tokenizer, messages, tools=[tool], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the")
    assert '<tool_call>\n{"name": "move", "arguments": {"direction": "left"}}\n</tool_call><|im_end|>\n' in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nYou moved left.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_bpe_generation_config_is_qwen3s(qwen3_bpe_dir: Path) -> None:
    config = GenerationConfig.from_pretrained(qwen3_bpe_dir, local_files_only=True)
    assert config.eos_token_id == [IM_END, ENDOFTEXT]
    assert (config.pad_token_id, config.bos_token_id) == (ENDOFTEXT, ENDOFTEXT)
    assert config.do_sample and (config.temperature, config.top_p, config.top_k) == (0.6, 0.95, 20)


def test_qwen3_bpe_forward_and_generate(qwen3_bpe_dir: Path, tokenizer: Any, one_thread: None) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen3_bpe_dir, local_files_only=True)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reverse abc."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.vocab_size)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=6)  # the checkpoint's own sampling settings
    new = out[0, inputs["input_ids"].shape[1] :]
    assert 1 <= len(new) <= 6 and int(new.max()) < model.config.vocab_size
    assert isinstance(tokenizer.decode(new), str)


def test_qwen3_bpe_cli_builds_the_same_model_for_the_same_seed(
    qwen3_bpe_dir: Path, cli_built: tuple[Path, int, str]
) -> None:
    out, code, printed = cli_built
    assert code == 0
    assert "29,304,320 parameters (bfloat16), vocabulary 8,026 tokens (8,064 embedding rows), seed 0" in printed
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (out / name).read_bytes() == (qwen3_bpe_dir / name).read_bytes(), name
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (out, qwen3_bpe_dir)]
    assert digest[0] == digest[1]
    assert build_parser().parse_args(["build-model", str(out)]).preset == "tiny"  # the default is unchanged


def test_qwen3_bpe_tokenizer_training_is_deterministic_across_processes() -> None:
    """The BPE trainer runs in Rust, whose hash maps are seeded per process: same seed, same merges anyway."""
    here = train_tokenizer(seed=0, sizes=SMALL).to_str()
    code = (
        "from rollart.models.qwen3_bpe import Qwen3BpeSizes, train_tokenizer; "
        "print(train_tokenizer(0, Qwen3BpeSizes(bpe_vocab_size=1000, corpus_documents=500)).to_str())"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == here
    assert train_tokenizer(seed=1, sizes=SMALL).to_str() != here  # the seed draws other documents


def test_qwen3_bpe_training_refuses_a_corpus_too_small_for_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="raise corpus_documents"):
        train_tokenizer(seed=0, sizes=Qwen3BpeSizes(bpe_vocab_size=8000, corpus_documents=50))
