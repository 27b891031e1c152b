"""The BPE test model: a ~30 M parameter Qwen3 with a byte-level BPE tokenizer, built here from a seed.

The tiny default model (`rollart.tiny.model`) has a character-level tokenizer and a toy chat template;
real runs use Qwen3 checkpoints. This one has what a real checkpoint has, at a size that builds in
seconds: a byte-level BPE tokenizer (Qwen2/Qwen3's pre-tokenizer regex, NFC, ByteLevel without prefix
space, so any text round-trips) trained on a generated corpus (`rollart.models.corpus`) of RollArt's
tasks, math, tool calls, code and chats; Qwen3's 26 added tokens with their ids after the BPE vocabulary
and their special flags; Qwen3's own chat template (thinking, tools); a `Qwen3ForCausalLM` saved in
bfloat16 with Qwen3's generation config. The weights are random: it is for testing machinery (template
rendering, token ids, loading, dtype handling, weight transfer), not for learning anything quickly.

    rollart build-model DIR --preset qwen3-bpe [--seed 0]
    python -m rollart.models.qwen3_bpe --out DIR [--seed 0]

The same seed gives the same tokenizer.json and the same weight bytes.

The chat template is the one Qwen3's hybrid-thinking checkpoints ship in tokenizer_config.json (the revision
with `message.content is string`; SkyRL's skyrl-train/skyrl_train/utils/templates/README.md calls it the
official one, links Qwen/Qwen3-8B at 895c8d171bc03c30e113cd7a28c02494b5e068b7, and quotes its assistant
branch, which matches). It is copied verbatim from a public training script that embeds it whole, and checked
byte for byte against akougkas/warpio-cli's warpio-docs/ai-docs/model_cards/qwen3:4b.md, a copy of
Qwen3-4B-Thinking-2507's tokenizer_config.json: identical up to the generation prompt, where the 2507 thinking
model always opens `<think>` and the hybrid models honour `enable_thinking`. tests/unit/test_qwen3_bpe.py
pins its sha256.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from rollart.models.corpus import documents

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase


def _tokens(text: str) -> tuple[str, ...]:
    return tuple(text.split())


SPECIAL_TOKENS = _tokens(
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|>"
)
OTHER_ADDED_TOKENS = _tokens(
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
    "<tool_response> </tool_response> <think> </think>"
)
ADDED_TOKENS = tuple((token, True) for token in SPECIAL_TOKENS) + tuple((token, False) for token in OTHER_ADDED_TOKENS)
"""Qwen3's added tokens in id order (151643...151668 there, right after the BPE vocabulary here too) and
whether each is special: Qwen3's tokenizer_config.json marks `<think>`, `<tool_call>`, the FIM tokens... not."""
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2/Qwen3's split before byte-level BPE: digits one by one, words with one leading non-letter."""
MARKER_FILE = "rollart-model.json"
"""As the tiny model's: how the folder was made."""

QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501


class Qwen3BpeSizes(msgspec.Struct, frozen=True, kw_only=True):
    """The BPE test model's dimensions; the defaults make about 30 M parameters."""

    bpe_vocab_size: int = 8000
    """Byte-level BPE tokens (256 bytes and the merges); the 26 added tokens come after them."""
    corpus_documents: int = 10_000
    """Generated documents the tokenizer is trained on (about 4.7 MB of text)."""
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = True
    """The output layer shares the input embedding (Qwen3's small checkpoints do). Untied, a model trained from
    scratch on targets that are interchangeable (random operands, random answers) keeps their tokens apart as
    inputs: tied, those tokens' embeddings are pulled together as outputs and the model can no longer tell them
    apart where it reads them (examples/calculator_agent/README.md)."""
    pad_vocab_to: int = 128
    """The embedding has a multiple of this many rows, some past the tokenizer, as Qwen3's (151,936 rows for
    151,669 tokens) has: code that takes `len(tokenizer)` for the vocabulary size is caught."""


DEFAULT_SIZES = Qwen3BpeSizes()


def train_tokenizer(seed: int = 0, sizes: Qwen3BpeSizes = DEFAULT_SIZES) -> Tokenizer:
    """The byte-level BPE `tokenizers.Tokenizer`, laid out as Qwen3's tokenizer.json, trained on the corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    tokenizer.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(**byte_level)])
    tokenizer.post_processor = processors.ByteLevel(**byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    # The added tokens are cut out of the text before BPE sees it, as they are at encode time.
    added = re.compile("|".join(re.escape(token) for token, _ in ADDED_TOKENS))
    pieces = (piece for doc in documents(seed, sizes.corpus_documents) for piece in added.split(doc) if piece)
    trainer = trainers.BpeTrainer(
        vocab_size=sizes.bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        continuing_subword_prefix="",  # as Qwen3's tokenizer.json has them (no prefix, no suffix)
        end_of_word_suffix="",
    )
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    if tokenizer.get_vocab_size() != sizes.bpe_vocab_size:
        raise ValueError(
            f"the corpus of {sizes.corpus_documents} documents gave {tokenizer.get_vocab_size()} BPE tokens, "
            f"not {sizes.bpe_vocab_size}: raise corpus_documents or lower bpe_vocab_size"
        )
    return tokenizer


def build_tokenizer(seed: int = 0, sizes: Qwen3BpeSizes = DEFAULT_SIZES) -> PreTrainedTokenizerBase:
    """The trained tokenizer as transformers' `Qwen2Tokenizer` (what `AutoTokenizer` gives for a Qwen3
    checkpoint), with Qwen3's added tokens, eos `<|im_end|>`, pad `<|endoftext|>`, no bos, and the chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    core = train_tokenizer(seed, sizes)
    core.add_tokens([AddedToken(token, special=special, normalized=False) for token, special in ADDED_TOKENS])
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,  # type: ignore[arg-type]  # Qwen3 has none: bytes cover everything
        bos_token=None,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),  # Qwen3's additional_special_tokens
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=sizes.max_position_embeddings,
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_qwen3_bpe_model(out_dir: Path, *, seed: int = 0, sizes: Qwen3BpeSizes = DEFAULT_SIZES) -> Path:
    """Build the tokenizer and a randomly initialised Qwen3 from `seed` and save both to `out_dir` in bfloat16,
    with Qwen3's generation config and a `rollart-model.json` that records how they were made."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    started = time.perf_counter()
    tokenizer = build_tokenizer(seed, sizes)
    token_id = {token: sizes.bpe_vocab_size + i for i, (token, _) in enumerate(ADDED_TOKENS)}
    if tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END]) != [token_id[ENDOFTEXT], token_id[IM_END]]:
        raise RuntimeError("the added tokens did not land right after the BPE vocabulary")
    config = Qwen3Config(
        vocab_size=-(-len(tokenizer) // sizes.pad_vocab_to) * sizes.pad_vocab_to,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=sizes.max_position_embeddings,
        max_window_layers=sizes.num_layers,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": sizes.rope_theta},
        tie_word_embeddings=sizes.tie_embeddings,
        bos_token_id=token_id[ENDOFTEXT],
        eos_token_id=token_id[IM_END],
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]
    # bfloat16, as Qwen3 checkpoints are stored (config.json says so on save). Module.to: transformers' own
    # wrapper of `to` confuses mypy.
    torch.nn.Module.to(model, torch.bfloat16)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=token_id[ENDOFTEXT],
        eos_token_id=[token_id[IM_END], token_id[ENDOFTEXT]],
        pad_token_id=token_id[ENDOFTEXT],
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {
        "kind": "rollart-qwen3-bpe",
        "preset": "qwen3-bpe",
        "seed": seed,
        **msgspec.structs.asdict(sizes),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "tokenizer_size": len(tokenizer),
        "build_s": round(time.perf_counter() - started, 2),
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Build the BPE test model into `--out` and print what was built."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokenizer corpus and the initial weights")
    args = parser.parse_args(argv)
    out = build_qwen3_bpe_model(args.out, seed=args.seed)
    marker: dict[str, Any] = json.loads((out / MARKER_FILE).read_text())
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    print(
        f"built Qwen3 BPE test model: {marker['parameters']:,} parameters (bfloat16), vocabulary "
        f"{marker['tokenizer_size']:,} tokens ({marker['vocab_size']:,} embedding rows), seed {marker['seed']}, "
        f"in {marker['build_s']:.1f} s, {size_mb:.1f} MB at {out.resolve()}"
    )


if __name__ == "__main__":
    main()
