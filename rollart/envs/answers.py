"""Reading the answer out of a model's reply: the one rule both envs and reward functions use.

`last_boxed` is how an env finds the action in a reply (`parse_choice`, `copy-reverse`) and how the
`exact-answer` reward finds the answer to grade (`rollart.rewards.functions`). It lives here, once,
so that the two never disagree: an action the env accepted must be the answer the reward scores.
Pure text code: the reward pool imports it without the env-host's execution machinery.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """The content of the last *complete* `\\boxed{...}` in `text` (its braces balanced), or None.

    The rule: of the boxes whose braces close, the one opened last. So
    - `\\boxed{left} then \\boxed{up` gives 'left': a reply cut off inside a box (a turn's token
      limit falls there) still has the complete answer it gave before; an unterminated box is no
      answer, and a complete one earlier in the reply is not taken back by it;
    - braces inside a box are kept, balanced: `\\boxed{\\frac{1}{2}}` gives '\\frac{1}{2}';
    - a box inside a box is opened last: `\\boxed{a \\boxed{b} c}` gives 'b';
    - no box, or none that closes: None (a format error to envs and to `exact-answer` alike).
    """
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None
