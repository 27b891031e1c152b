"""Conversations to token ids with the model's own chat template, keeping every generated token as sampled.

A trajectory's tokens are the first prompt, then for each turn the ids the generator sampled (kept exactly:
they are what the log-probs belong to) and the text the template puts between that reply and the next
generation: the end of the assistant's turn, the observation as a user turn, the next assistant header. Only
text that came from the environment or the template is ever tokenized.

What the model is shown on the next turn is the task's choice (`TaskSpec.context`):
- `full`: the conversation as it happened, the model's earlier replies token for token, their thinking
  included: one growing sequence per trajectory, trained once (the cheapest).
- `template`: exactly what the chat template renders for the conversation so far. Templates that rewrite
  earlier turns (Qwen3 drops the `<think>` block of every assistant turn before the last user message)
  then make a prompt that is not the previous one plus the reply; such a turn starts a fresh sequence
  (`NextTurn.fresh`), which the trainer trains on its own with the trajectory's advantage.
- `last`: the system prompt and the latest observation alone (`first_prompt` each turn).

Stop tokens come from the model, not from a template family: the tokenizer's EOS, the generation config's
EOS ids, and the token the chat template closes an assistant turn with (`<|im_end|>` for ChatML, Qwen and
the tiny model, `<|eot_id|>` for Llama 3), found by rendering a probe conversation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

_PROBE = "RollArtProbeReply7f3c"
"""Stands for an assistant reply in a probe rendering: plain ASCII, no whitespace, so no template trims it."""
THINK_END = "</think>"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer a trajectory uses."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: list[int], **kwargs: Any) -> str: ...

    def convert_ids_to_tokens(self, ids: int) -> Any: ...


@dataclass(frozen=True)
class NextTurn:
    """What follows a generated reply: `ids` after it in the same sequence, or (`fresh`) a whole new prompt."""

    ids: list[int]
    fresh: bool


class ChatRenderer:
    """Turns a conversation into token ids with the model's own chat template (see the module docstring).

    `stop_ids`: more ids that end a turn, e.g. the generation config's `eos_token_id` list
    (`rollart.models.checkpoint.generation_eos_ids`).
    """

    def __init__(self, tokenizer: Tokenizer, *, stop_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        turn_end = self._turn_end_id()
        stops = {tokenizer.eos_token_id, *stop_ids, turn_end}
        self.stop_ids = sorted(i for i in stops if isinstance(i, int) and i >= 0)
        self.turn_end_id = turn_end if turn_end is not None else tokenizer.eos_token_id
        """The token a model ends its turn with (the template's, else EOS); None when it has neither."""

    def _turn_end_id(self) -> int | None:
        """The special token the template closes an assistant turn with, if it uses one."""
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render(conversation, generation_prompt=False)
        except Exception:  # any template error: a template without assistant turns teaches no stop token
            return None
        after = text[text.rfind(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
        ids = self.encode(after)
        special = set(getattr(self.tokenizer, "all_special_ids", ())) | set(_added_ids(self.tokenizer))
        return ids[0] if ids and ids[0] in special else None

    def render(
        self, messages: list[dict[str, Any]], *, generation_prompt: bool, options: Mapping[str, Any] | None = None
    ) -> str:
        """The template's text for `messages`; `options`: its keyword arguments (e.g. `enable_thinking`)."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **(options or {})
        )
        if not isinstance(text, str):  # a check, not an assert: `python -O` would drop it
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text (tokenize=False)")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @staticmethod
    def answer(reply: str) -> str:
        """What the environment acts on and the reward reads: the reply after its thinking, if it thought."""
        return reply.rsplit(THINK_END, 1)[1].lstrip("\n") if THINK_END in reply else reply

    def first_prompt(
        self, system: str, observation: str, options: Mapping[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], list[int]]:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": observation})
        return messages, self.encode(self.render(messages, generation_prompt=True, options=options))

    def next_turn(
        self,
        messages: list[dict[str, str]],
        reply: str,
        generated: list[int],
        observation: str,
        *,
        as_template: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> NextTurn:
        """What follows the generated reply: the end of the assistant turn, the observation as the next user
        turn, and the next generation prompt. `as_template`: the template's own rendering of the whole
        conversation, a fresh prompt when it is not the previous prompt plus the reply (`context: template`);
        otherwise always the continuation (`context: full`). `messages` is extended."""
        before = self.render(messages, generation_prompt=True, options=options) if as_template else ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        if as_template:
            after = self.render(messages, generation_prompt=True, options=options)
            if not after.startswith(before + reply):
                return NextTurn(self.encode(after), fresh=True)
            tail = after[len(before) + len(reply) :]
            return NextTurn(self.encode(self._after_stop(generated, tail)), fresh=False)
        return NextTurn(self.continuation(messages[:-2], generated, messages[-1:], options=options), fresh=False)

    def continuation(
        self,
        before: list[dict[str, Any]],
        generated: list[int],
        following: list[dict[str, Any]],
        *,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids that follow a generated assistant reply (`generated`, sampled after the prompt of `before`)
        when the conversation goes on with `following` (user turns, tool results): the end of the assistant
        turn, each following message, the next generation prompt. Only template text is tokenized; the
        reply's own tokens stay as sampled."""
        probe = [*before, {"role": "assistant", "content": _PROBE}, *following]
        text = self.render(probe, generation_prompt=True, options=options)
        if _PROBE not in text:
            raise ValueError("the chat template does not show an assistant reply's content")
        return self.encode(self._after_stop(generated, text[text.rfind(_PROBE) + len(_PROBE) :]))

    def _after_stop(self, generated: list[int], tail: str) -> str:
        """`tail` without the end-of-turn text the model already generated as its last token."""
        if generated and generated[-1] in self.stop_ids:
            stop_text = self.tokenizer.convert_ids_to_tokens(generated[-1])
            if isinstance(stop_text, str) and tail.startswith(stop_text):
                return tail[len(stop_text) :]
        return tail


def _added_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's added tokens (ChatML's markers are added tokens, special or not)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    return list(added) if isinstance(added, dict) else []
