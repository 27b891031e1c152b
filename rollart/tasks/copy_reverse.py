"""copy-reverse: a decode-heavy, single-turn task small enough for a tiny char-level model.

The prompt gives a random string over a small alphabet (default `abcdefgh`, length 16-32) and
asks for it reversed inside `\\boxed{...}` (with `mode="copy"`: copied; with `mode="repeat"` the
prompt gives one letter and the answer is that letter, as many times as the string would be long:
a tiny model learns it by RL in minutes, and a reply that repeats the wrong letter scores 0, below
the random policy's 1/len(alphabet), so the collapse to one repeated letter that GRPO drifts into
on copy or reverse is not a resting place here; with `boxed=False` the whole reply is the answer,
no format to get wrong). The reward gives
partial credit, so a tiny model can improve gradually: the fraction of positions where the answer
matches the reversed string, counted over the longer of the two (padding does not pay), 1.0 for an
exact answer. A reply with no `\\boxed{...}` gets the format penalty. `info["answer"]` holds the
reference (on reset and on step), for reward functions that score elsewhere. Sample (seed 0):

    Reverse this string: gaehgehfdcecbecebbfhbfgfdhhe
    Put the reversed string in \\boxed{}.
"""

from __future__ import annotations

import random
from typing import Literal

from rollart.envs.answers import last_boxed
from rollart.envs.base import FORMAT_PENALTY, Env, Info, StepResult, not_running, require, resolve_seed

SYSTEM_PROMPT = "Write the given string reversed inside \\boxed{}. Example: abc -> \\boxed{cba}"
COPY_SYSTEM_PROMPT = "Write the given string inside \\boxed{}. Example: abc -> \\boxed{abc}"
REPEAT_SYSTEM_PROMPT = (
    "Write the given letter the given number of times inside \\boxed{}. Example: 3 times: a -> \\boxed{aaa}"
)
Mode = Literal["reverse", "copy", "repeat"]
_VERBS = {"reverse": ("Reverse", "the reversed string"), "copy": ("Copy", "it"), "repeat": ("Repeat", "them")}


def position_match(answer: str, reference: str) -> float:
    """Fraction of positions where `answer` equals `reference`, over the longer of the two."""
    length = max(len(answer), len(reference))
    if length == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, reference, strict=False)) / length


class CopyReverseEnv(Env):
    """Reverse a random string; one turn; partial credit per position."""

    name = "copy-reverse"
    profile = "decode-heavy"
    max_turns = 1
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        min_len: int = 16,
        max_len: int = 32,
        alphabet: str = "abcdefgh",
        format_penalty: float = FORMAT_PENALTY,
        mode: Mode = "reverse",
        boxed: bool = True,
    ) -> None:
        require(1 <= min_len <= max_len, self.name, f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        require(
            alphabet != "" and alphabet.isalnum() and len(set(alphabet)) == len(alphabet),
            self.name,
            f"alphabet must be distinct letters or digits, got {alphabet!r}",
        )
        self.min_len = min_len
        self.max_len = max_len
        require(mode in _VERBS, self.name, f"mode must be one of {', '.join(_VERBS)}, got {mode!r}")
        self.alphabet = alphabet
        self.mode = mode
        self.boxed = boxed
        if mode != "reverse":
            self.system_prompt = COPY_SYSTEM_PROMPT if mode == "copy" else REPEAT_SYSTEM_PROMPT
        if not boxed:
            self.system_prompt = ""  # the observation says it all; the whole reply is the answer
        self.format_penalty = format_penalty
        self._answer: str | None = None

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode_seed = resolve_seed(seed)
        rng = random.Random(episode_seed)
        length = rng.randint(self.min_len, self.max_len)
        verb, what = _VERBS[self.mode]
        if self.mode == "repeat":
            letter = rng.choice(self.alphabet)
            self._answer = letter * length
            task = f"{verb} this letter {length} times: {letter}\n"
        else:
            text = "".join(rng.choice(self.alphabet) for _ in range(length))
            self._answer = text if self.mode == "copy" else text[::-1]
            task = f"{verb} this string: {text}\n"
        obs = task + (f"Put {what} in \\boxed{{}}." if self.boxed else "")
        return obs, {"seed": episode_seed, "answer": self._answer}

    def sample_action(self, rng: random.Random) -> str | None:
        if self._answer is None:
            return None
        guess = "".join(rng.choice(self.alphabet) for _ in self._answer)
        return f"\\boxed{{{guess}}}" if self.boxed else guess

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise not_running(self.name)
        answer, self._answer = self._answer, None
        boxed = last_boxed(action) if self.boxed else action
        info: Info = {"answer": answer, "format_error": boxed is None, "turn": 1, "success": False}
        if boxed is None:
            return "No \\boxed{...} answer found.", self.format_penalty, True, False, info
        score = position_match(boxed.strip(), answer)
        info["success"] = score == 1.0
        return f"The answer is {answer}.", score, True, False, info
