"""The text the BPE test model's tokenizer is trained on: generated here from a seed, nothing downloaded.

It covers what RollArt shows a model: the built-in tasks' observations and replies in their own words
(FrozenLake and Sokoban boards, copy-reverse strings), arithmetic and word problems with `\\boxed{...}`
answers, English-shaped sentences, JSON tool definitions, calls and results, Python-like code, runs of
whitespace, and chat transcripts in Qwen's format with `<think>` blocks. The same seed gives the same
documents in the same order, so the tokenizer trained on them is the same too.

    python -m rollart.models.corpus [--seed 0] [--docs 40]   # print a sample

Standard library only. `rollart.models` imports no other part of RollArt (tests/unit/test_import_rules.py),
so the tasks' texts are restated here; tests/unit/test_qwen3_bpe.py checks the tokenizer on the real ones.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
from collections.abc import Callable, Iterator

NAMES = ("Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Gustav", "Hana", "Ivan", "Jun", "Kofi", "Lena")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "stamps", "tickets", "cookies", "boxes", "cards")


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


NOUNS = _words(
    "agent model board goal hole box wall target step turn reward policy batch token prompt answer reply trainer "
    "generator buffer weight version engine node worker queue request result error file folder river mountain city "
    "garden window kitchen teacher student market train letter number string question problem system message tool "
    "function argument value record table chart road bridge forest ocean island village school library museum "
    "doctor farmer painter writer player driver robot planet station engineer dataset benchmark gradient sample "
    "episode rollout checkpoint process thread socket server client memory device cluster schedule budget report"
)
VERBS = _words(
    "reads writes moves pushes finds sends waits checks builds returns keeps drops learns plays sees opens closes "
    "starts stops counts measures updates loads saves trains samples computes compares explains describes follows "
    "carries brings watches changes fixes breaks makes takes gives holds turns walks runs jumps climbs crosses"
)
ADJECTIVES = _words(
    "small large quick slow new old empty full short long simple careful random stale fresh bright dark warm cold "
    "heavy light early late hidden open narrow wide quiet loud clean broken strong weak green blue red yellow"
)
ADVERBS = _words("quickly slowly again first then later often never always carefully soon today together alone")
ONSETS = _words("b c d f g h j k l m n p r s t v w z br cl dr fl gr pl pr sh st th tr ch sp str qu")
VOWELS = _words("a e i o u ai ea ee oo ou io ie")
CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "nt", "x")
PREFIXES = ("", "", "", "", "un", "re", "pre", "dis", "in", "over", "sub", "inter")
SUFFIXES = ("", "", "", "s", "ing", "ed", "er", "tion", "ment", "ly", "ness", "able", "al", "ive", "ous", "ity")
LEXICON_SIZE = 6000
"""Made-up words beside the real ones: enough distinct, English-shaped words that the merges go to
syllables and frequent words, not to the random letter strings of copy-reverse."""


@functools.cache
def lexicon() -> tuple[tuple[str, ...], list[float]]:
    """`LEXICON_SIZE` made-up words (prefix, one to three syllables, suffix) and their cumulative Zipf weights.
    Fixed (its own seed): the build seed changes which documents are drawn, not the language they are in."""
    rng = random.Random(1234)
    words: dict[str, None] = {}
    while len(words) < LEXICON_SIZE:
        syllables = "".join(
            rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )
        words[rng.choice(PREFIXES) + syllables + rng.choice(SUFFIXES)] = None
    return tuple(words), list(itertools.accumulate(1.0 / (rank + 1) for rank in range(LEXICON_SIZE)))


def _word(rng: random.Random) -> str:
    if rng.random() < 0.5:
        words, cumulative = lexicon()
        return rng.choices(words, cum_weights=cumulative)[0]
    return rng.choice(rng.choice((NOUNS, VERBS, ADJECTIVES, ADVERBS, THINGS)))


UNICODE_LINES = (
    "Café, naïve, façade, déjà vu: accents survive.",
    "Grüße aus München! Ça va? ¿Qué tal? Ünïcödé.",
    "数学题：三加五等于八。答案是 \\boxed{8}。",
    "日本語のテキストと한국어 텍스트도 있습니다.",
    "Emoji: 🙂 🚀 🎯 ✅ ❌ 🔥 — and arrows → ← ↑ ↓.",
    "Greek: α + β = γ, π ≈ 3.14159, Σ x_i, ∀ε > 0 ∃δ.",
)
TOOLS = (
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("search", {"query": "frozen lake shortest path", "top_k": 3}),
    ("calculator", {"expression": "12 * (7 + 5)"}),
    ("read_file", {"path": "configs/local.yaml"}),
    ("move", {"direction": "left"}),
    ("run_python", {"code": "print(sum(range(10)))"}),
)


def _sentence(rng: random.Random) -> str:
    """A sentence of real and made-up words: a capital at the start, now and then a comma or a name."""
    words = [_word(rng) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words[rng.randrange(len(words))] = rng.choice(NAMES)
    if rng.random() < 0.3:
        words[rng.randrange(len(words) - 1)] += ","
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "!", "?", ":"))


def english(rng: random.Random) -> str:
    """A paragraph of short English-like sentences; now and then a line of other scripts and emoji."""
    text = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
    return text + ("\n" + rng.choice(UNICODE_LINES) if rng.random() < 0.15 else "")


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(question, reasoning, boxed answer) for a sum, a product or a word problem."""
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    kind = rng.randrange(3)
    if kind == 0:
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", f"\\boxed{{{a + b}}}"
    if kind == 1:
        return f"Compute {a} * {b}.", f"{a} * {b} = {a * b}.", f"\\boxed{{{a * b}}}"
    name, thing, c = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, b)
    question = f"{name} has {b} {thing}, buys {a} more and gives away {c}. How many {thing} are left?"
    return question, f"{b} + {a} = {a + b}, then {a + b} - {c} = {a + b - c}.", f"\\boxed{{{a + b - c}}}"


def tool_json(rng: random.Random) -> tuple[str, str, str]:
    """(tool definition, tool call, tool result) as the Qwen3 chat template renders them."""
    name, arguments = rng.choice(TOOLS)
    properties = {key: {"type": "integer" if isinstance(v, int) else "string"} for key, v in arguments.items()}
    definition = {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{_sentence(rng)[:-1]}.",
            "parameters": {"type": "object", "properties": properties, "required": list(arguments)},
        },
    }
    call = json.dumps({"name": name, "arguments": arguments})
    result = json.dumps({"ok": rng.random() < 0.8, "value": rng.randint(-50, 500), "note": rng.choice(NOUNS)})
    return json.dumps(definition), call, result


def code(rng: random.Random) -> str:
    """A few lines of Python-like code, four-space indented."""
    fn, arg, noun = rng.choice(VERBS)[:-1], rng.choice(("x", "items", "board", "batch")), rng.choice(NOUNS)
    n = rng.randint(2, 64)
    return (
        f"def {fn}_{noun}({arg}, limit={n}):\n"
        f'    """{_sentence(rng)}"""\n'
        f"    total = 0\n"
        f"    for i, value in enumerate({arg}):\n"
        f"        if i >= limit:\n"
        f"            break\n"
        f"        total += value * {rng.randint(1, 9)}\n"
        f"    return {{'{noun}': total, 'count': len({arg})}}\n"
    )


def whitespace(rng: random.Random) -> str:
    """Runs of spaces, tabs and blank lines between short words."""
    parts = [
        rng.choice(NOUNS) + " " * rng.randint(0, 8) + rng.choice(("", "\t", "\n", "\n\n", "\r\n")) for _ in range(8)
    ]
    return "".join(parts)


GRID_SYSTEM_PROMPT = (
    "You are playing a grid game, one move per turn. The board is drawn as rows of characters, top row first. "
    "Think briefly, then end your reply with exactly one move: \\boxed{up}, \\boxed{down}, \\boxed{left} or "
    "\\boxed{right}."
)
LETTER_SYSTEM_PROMPT = (
    "You are playing a grid game, one move per turn. The board is drawn as rows of characters, top row first. "
    "Reply with one letter: U (up), D (down), L (left) or R (right)."
)
MOVE_HINT = "Answer with \\boxed{up}, \\boxed{down}, \\boxed{left} or \\boxed{right}."
LETTER_HINT = "Answer U, D, L or R."
INTROS = {
    "lake": "You are on a frozen lake. Reach the goal G without falling into a hole H.\n"
    "Legend: P you, S start, F frozen ice, H hole, G goal.",
    "sokoban": "Sokoban: push the box $ onto the target . (you can push, never pull).\n"
    "Legend: @ you, $ box, . target, * box on target, + you on target, # wall, _ floor.",
}
FEEDBACK = {
    "lake": (
        "You moved {}.",
        "You cannot move {}: that is the edge of the lake.",
        "You moved {} and fell into a hole.",
    ),
    "sokoban": ("You moved {}.", "You cannot move {}: there is a wall.", "You pushed the box {}."),
}
DIRECTIONS = ("up", "down", "left", "right")


def _board(rng: random.Random, game: str, size: int) -> list[str]:
    """A board as the grid tasks draw it: a lake of F and H with S, G and P, or a walled Sokoban room."""
    if game == "lake":
        cells = [["H" if rng.random() < 0.2 else "F" for _ in range(size)] for _ in range(size)]
        marks = "SGP"
    else:
        cells = [["#" if r in (0, size - 1) or c in (0, size - 1) else "_" for c in range(size)] for r in range(size)]
        marks = rng.choice(("$.@", "$.@", "*@", "$+"))
    inner = range(1, size - 1) if game == "sokoban" else range(size)
    for mark, (r, c) in zip(marks, rng.sample([(r, c) for r in inner for c in inner], len(marks)), strict=True):
        cells[r][c] = mark
    return ["".join(row) for row in cells]


def grid_game(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """A FrozenLake or Sokoban episode in the tasks' words: the system prompt and (observation, reply) turns.
    The boards are redrawn each turn rather than played, which is all a tokenizer needs of them."""
    game, letters = rng.choice(("lake", "sokoban")), rng.random() < 0.3
    compact, position = rng.random() < 0.3, rng.random() < 0.3
    hint = LETTER_HINT if letters else MOVE_HINT
    system = f"{INTROS[game]}\n{hint}" if compact else LETTER_SYSTEM_PROMPT if letters else GRID_SYSTEM_PROMPT
    size, max_turns = rng.randint(3, 7) if game == "lake" else rng.randint(5, 8), rng.randint(4, 12)
    turns: list[tuple[str, str]] = []
    for turn in range(rng.randint(1, max_turns)):
        direction = rng.choice(DIRECTIONS)
        lines = [] if compact or turn == 0 else [rng.choice(FEEDBACK[game]).format(direction)]
        lines += [INTROS[game]] if turn == 0 and not compact else []
        lines += _board(rng, game, size)
        lines += [f"You are at row {rng.randint(1, size)}, column {rng.randint(1, size)}."] if position else []
        lines += [] if compact else [f"Turns left: {max_turns - turn}. {hint}"]
        turns.append(("\n".join(lines), direction[0].upper() if letters else f"\\boxed{{{direction}}}"))
    return system, turns


def copy_reverse(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """A copy-reverse episode (reverse, copy or repeat a random string) and a right or a random reply."""
    text = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(16, 32)))
    guess = "".join(rng.choice("abcdefgh") for _ in text)
    mode = rng.randrange(3)
    if mode == 0:
        system = "Write the given string reversed inside \\boxed{}. Example: abc -> \\boxed{cba}"
        prompt, answer = f"Reverse this string: {text}\nPut the reversed string in \\boxed{{}}.", text[::-1]
    elif mode == 1:
        system = "Write the given string inside \\boxed{}. Example: abc -> \\boxed{abc}"
        prompt, answer = f"Copy this string: {text}\nPut it in \\boxed{{}}.", text
    else:
        system = (
            "Write the given letter the given number of times inside \\boxed{}. Example: 3 times: a -> \\boxed{aaa}"
        )
        prompt, answer = (
            f"Repeat this letter {len(text)} times: {text[0]}\nPut them in \\boxed{{}}.",
            text[0] * len(text),
        )
    return system, [(prompt, f"\\boxed{{{answer if rng.random() < 0.5 else guess}}}")]


def _turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def chat(rng: random.Random) -> str:
    """A whole transcript in Qwen3's chat format: a task episode, a math question, or a tool exchange."""
    kind = rng.randrange(3)
    if kind == 0:
        system, turns = grid_game(rng) if rng.random() < 0.75 else copy_reverse(rng)
        text = _turn("system", system)
        for observation, action in turns:
            thought = f"<think>\n{_sentence(rng)} I will answer {action}.\n</think>\n\n" if rng.random() < 0.5 else ""
            text += _turn("user", observation) + _turn("assistant", thought + action)
        return text
    if kind == 1:
        question, reasoning, answer = arithmetic(rng)
        reply = f"<think>\n{reasoning}\n</think>\n\nThe answer is {answer}."
        return _turn("user", question + " Put the answer in \\boxed{}.") + _turn("assistant", reply)
    definition, call, result = tool_json(rng)
    system = f"# Tools\n\nYou may call one or more functions.\n<tools>\n{definition}\n</tools>"
    reply = f"<think>\n{_sentence(rng)}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    response = f"<tool_response>\n{result}\n</tool_response>"
    return _turn("system", system) + _turn("user", english(rng)) + _turn("assistant", reply) + _turn("user", response)


GENERATORS: tuple[tuple[Callable[[random.Random], str], int], ...] = (
    (chat, 6),
    (english, 3),
    (lambda rng: "\n".join(arithmetic(rng)), 2),
    (lambda rng: "\n".join(tool_json(rng)), 1),
    (code, 1),
    (whitespace, 1),
)
"""Each kind of document and its weight."""


def documents(seed: int, count: int) -> Iterator[str]:
    """`count` documents drawn from `seed`: the same seed gives the same documents in the same order."""
    rng = random.Random(seed)
    kinds = [generate for generate, weight in GENERATORS for _ in range(weight)]
    for _ in range(count):
        yield rng.choice(kinds)(rng)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs", type=int, default=40)
    args = parser.parse_args(argv)
    for document in documents(args.seed, args.docs):
        print(document, end="\n\n")


if __name__ == "__main__":
    main()
