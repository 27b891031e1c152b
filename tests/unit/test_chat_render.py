"""The chat renderer on real checkpoints: stop tokens from the model (tokenizer, generation config, the template's
end of turn), Qwen3's thinking through its own chat template, and what each `context` choice puts in the next turn.

Run on the BPE test model (`rollart build-model --preset qwen3-bpe`: Qwen3's template and special tokens) and on
the tiny default model; `-k stop_tokens` and `-k thinking` select them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollart.models.checkpoint import engine_dtype, generation_eos_ids, saved_dtype
from rollart.rollout.render import ChatRenderer

THOUGHT = "<think>\nthe hole is below\n</think>\n\n"


def load(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def renderer_for(path: Path) -> ChatRenderer:
    return ChatRenderer(load(path), stop_ids=generation_eos_ids(path))


def reply_ids(renderer: ChatRenderer, text: str) -> list[int]:
    """What a model that ended its turn itself generated for `text`."""
    assert renderer.turn_end_id is not None
    return [*renderer.encode(text), renderer.turn_end_id]


def test_stop_tokens_of_qwen3_come_from_its_generation_config_and_template(qwen3_bpe_dir: Path) -> None:
    tokenizer = load(qwen3_bpe_dir)
    renderer = renderer_for(qwen3_bpe_dir)
    names = [tokenizer.convert_ids_to_tokens(i) for i in renderer.stop_ids]
    assert sorted(names) == ["<|endoftext|>", "<|im_end|>"]
    assert renderer.turn_end_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation_eos_ids(qwen3_bpe_dir) == sorted(renderer.stop_ids)


def test_stop_tokens_of_the_tiny_model_include_its_turn_end(tiny_model: Path) -> None:
    tokenizer = load(tiny_model)
    renderer = renderer_for(tiny_model)
    names = {tokenizer.convert_ids_to_tokens(i) for i in renderer.stop_ids}
    assert names == {"<|endoftext|>", "<|im_end|>"}  # the tokenizer's EOS, and `<|im_end|>` from its template


def test_stop_tokens_follow_a_template_of_another_family(qwen3_bpe_dir: Path) -> None:
    """A Llama-3-shaped template whose turns end with another special token: that token stops generation, and
    `<|im_end|>` (ChatML's) only because this tokenizer's EOS is it, not because it is hard-coded."""
    tokenizer = load(qwen3_bpe_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<|box_start|>{{ m['role'] }}<|box_end|>\n\n{{ m['content'] }}<|quad_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|box_start|>assistant<|box_end|>\n\n{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|quad_end|>")
    assert renderer.turn_end_id == end
    assert set(renderer.stop_ids) == {end, tokenizer.eos_token_id}
    messages, _ = renderer.first_prompt("", "hi")
    turn = renderer.next_turn(messages, "left", [*renderer.encode("left"), end], "board 2")
    assert (
        tokenizer.decode(turn.ids)
        == "<|box_start|>user<|box_end|>\n\nboard 2<|quad_end|><|box_start|>assistant<|box_end|>\n\n"
    )


def test_stop_tokens_come_from_a_generation_config_list_and_bad_ones_are_refused(tmp_path: Path) -> None:
    from rollart.errors import ConfigError

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 3, 7]}')
    assert generation_eos_ids(tmp_path) == [3, 7]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "<|im_end|>"}')
    with pytest.raises(ConfigError, match="eos_token_id: expected an integer or a list of integers"):
        generation_eos_ids(tmp_path)
    assert generation_eos_ids(tmp_path / "missing") == []


def test_dtypes_come_from_the_checkpoint_and_the_device(qwen3_bpe_dir: Path, tiny_model: Path) -> None:
    assert saved_dtype(qwen3_bpe_dir) == "bfloat16"
    assert engine_dtype("auto", qwen3_bpe_dir, on_gpu=False) == "bfloat16"
    assert engine_dtype("auto", tiny_model, on_gpu=False) == "float32"
    assert engine_dtype("float32", qwen3_bpe_dir, on_gpu=True) == "float32"


def test_dtype_float16_checkpoints_run_in_float32_off_the_gpu(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert engine_dtype("auto", tmp_path, on_gpu=False) == "float32"
    assert engine_dtype("auto", tmp_path, on_gpu=True) == "float16"


def test_thinking_off_adds_qwen3s_empty_think_block_to_every_generation_prompt(qwen3_bpe_dir: Path) -> None:
    renderer = renderer_for(qwen3_bpe_dir)
    off = {"enable_thinking": False}
    messages, ids = renderer.first_prompt("rules", "board 1", off)
    assert renderer.tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    _, on = renderer.first_prompt("rules", "board 1")
    assert renderer.tokenizer.decode(on).endswith("<|im_start|>assistant\n")
    turn = renderer.next_turn(messages, "left", reply_ids(renderer, "left"), "board 2", options=off)
    assert not turn.fresh
    assert renderer.tokenizer.decode(turn.ids) == (
        "\n<|im_start|>user\nboard 2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_thinking_kept_in_full_context_is_the_tokens_the_model_generated(qwen3_bpe_dir: Path) -> None:
    """`context: full`: the next turn continues the sequence after the generated ids, thinking and all."""
    renderer = renderer_for(qwen3_bpe_dir)
    messages, prompt = renderer.first_prompt("rules", "board 1")
    generated = reply_ids(renderer, THOUGHT + "left")
    turn = renderer.next_turn(messages, renderer.decode(generated), generated, "board 2")
    assert not turn.fresh
    sequence = renderer.tokenizer.decode(prompt + generated + turn.ids)
    assert THOUGHT + "left<|im_end|>\n<|im_start|>user\nboard 2<|im_end|>\n<|im_start|>assistant\n" in sequence


def test_thinking_dropped_by_the_template_starts_a_fresh_sequence(qwen3_bpe_dir: Path) -> None:
    """`context: template`: the next prompt is exactly what Qwen3's template shows, the earlier thinking gone;
    it is not the previous prompt plus the reply, so it starts a sequence of its own."""
    renderer = renderer_for(qwen3_bpe_dir)
    messages, _ = renderer.first_prompt("rules", "board 1")
    generated = reply_ids(renderer, THOUGHT + "left")
    reply = renderer.decode(generated)
    turn = renderer.next_turn(list(messages), reply, generated, "board 2", as_template=True)
    assert turn.fresh
    text = renderer.tokenizer.decode(turn.ids)
    assert "<think>" not in text and "the hole is below" not in text
    expected = renderer.render(
        [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "board 2"}],
        generation_prompt=True,
    )
    assert renderer.encode(expected) == turn.ids


def test_thinking_free_replies_extend_the_template_sequence(qwen3_bpe_dir: Path) -> None:
    """Where the template shows the conversation verbatim (a reply without thinking), `template` continues the
    sequence as `full` does: nothing is re-encoded."""
    renderer = renderer_for(qwen3_bpe_dir)
    messages, _ = renderer.first_prompt("rules", "board 1")
    generated = reply_ids(renderer, "left")
    full = renderer.next_turn(list(messages), "left", generated, "board 2")
    template = renderer.next_turn(list(messages), "left", generated, "board 2", as_template=True)
    assert not template.fresh and template.ids == full.ids


def test_thinking_is_not_what_the_environment_acts_on() -> None:
    assert ChatRenderer.answer(THOUGHT + "\\boxed{left}") == "\\boxed{left}"
    assert ChatRenderer.answer("\\boxed{up}") == "\\boxed{up}"
    assert ChatRenderer.answer("<think>\nunfinished") == "<think>\nunfinished"  # cut off while thinking
