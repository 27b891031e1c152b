"""The tiny default model, built here from a seed (nothing is downloaded), and the one loading path for HF folders.

The default run trains a ~1 M parameter `Qwen3ForCausalLM` with a character-level tokenizer made for the built-in
tasks: one token per printable ASCII character and newline, plus the Qwen chat special tokens. Both are saved in
Hugging Face format, so every engine loads the tiny model exactly as it would load a real one.

    python -m rollart.tiny.model --out models/tiny [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IM_START, IM_END, UNK_TOKEN)
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")
"""Printable ASCII (letters, digits, punctuation, space) and newline: 96 characters."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen-style: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then the assistant header on request."""

MARKER_FILE = "rollart-model.json"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: one token per character, special tokens atomic, unknowns to `<|unk|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class TinySizes(msgspec.Struct, frozen=True, kw_only=True):
    """The tiny model's dimensions; the defaults make about 1 M parameters."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    vocab_size: int = 0
    """0: the tokenizer's own (101); larger ones (Qwen3's 151,936, for benchmarks) leave ids past the
    tokenizer unused."""
    tie_word_embeddings: bool = True
    """False: an output head of its own, as the larger Qwen3 models have."""


DEFAULT_SIZES = TinySizes()
"""The default run's tiny model."""


def build_tiny_model(out_dir: Path, *, seed: int = 0, sizes: TinySizes = DEFAULT_SIZES) -> Path:
    """Build the tiny Qwen3 model from `seed` and save it (safetensors) with its tokenizer to `out_dir`.

    The same seed and sizes give the same weight bytes. A `rollart-model.json` records how it was made."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=sizes.vocab_size or len(tokenizer),
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        head_dim=sizes.hidden_size // sizes.num_heads,
        max_position_embeddings=sizes.max_position_embeddings,
        tie_word_embeddings=sizes.tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index(IM_START),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    model.generation_config.pad_token_id = SPECIAL_TOKENS.index(PAD_TOKEN)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {
        "kind": "rollart-tiny",
        "seed": seed,
        **msgspec.structs.asdict(sizes),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def ensure_tiny_model(path: Path, *, seed: int = 0, prepare: Callable[[Path], None] | None = None) -> Path:
    """Build the tiny model at `path` unless a model (a `config.json`) is already there.

    `prepare(folder)` runs on the built model before it is moved into place (the format warm-up).

    Safe when several processes call it at once: each builds into a temporary folder beside `path` and renames it
    into place; a process that loses the race drops its copy and uses the winner's."""
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        build_tiny_model(staging, seed=seed)
        if prepare is not None:
            prepare(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        try:
            os.rename(staging, path)  # atomic; replaces an empty folder, fails on a full one
        except OSError:
            if not (path / "config.json").exists():
                raise  # not another builder's model: something else is in the way
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    """Build the tiny model into `--out` and print what was built."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed for the initial weights")
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out, seed=args.seed)
    marker: dict[str, Any] = json.loads((out / MARKER_FILE).read_text())
    print(
        f"built tiny Qwen3 model: {marker['parameters']:,} parameters, vocab {marker['vocab_size']}, "
        f"seed {marker['seed']}, at {out.resolve()}"
    )


if __name__ == "__main__":
    main()
