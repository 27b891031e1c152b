"""Tool calls in the model's own format, to and from OpenAI's `tool_calls`.

Qwen3 (and the BPE test model, which has Qwen3's chat template) calls a tool by writing, in its reply,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * 7"}}
    </tool_call>

once per call. The chat template shows the model the request's `tools` and renders earlier calls the same
way, so nothing here tokenizes: a reply is parsed after it was generated, and a call the model got wrong
is a `MalformedToolCall` whose message says what is wrong, for the agent to show the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rollart.errors import RollartError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class MalformedToolCall(RollartError):
    """The model's reply calls a tool in a way that cannot be parsed or is not allowed."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def openai(self, call_id: str) -> dict[str, Any]:
        """As an item of an OpenAI message's `tool_calls` (arguments as a JSON string, as OpenAI sends them)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """The function names a request's `tools` declares; raises `ValueError` for a malformed declaration."""
    names = set()
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] is not {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function has no name")
        names.add(name)
    return names


def forced_tool(tool_choice: Any, allowed: set[str]) -> str | None:
    """The tool a request's `tool_choice` forces (`{"type": "function", "function": {"name": ...}}`), else None;
    raises `ValueError` for a choice OpenAI's API would refuse."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not allowed:
            raise ValueError("tool_choice 'required' needs tools")
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a named function, not {tool_choice!r}")
    if name not in allowed:
        raise ValueError(f"tool_choice names {name!r}, which is not among the request's tools")
    return name


def parse_tool_calls(text: str, *, allowed: set[str], choice: Any = None) -> tuple[str | None, list[ToolCall]]:
    """Split a reply into its text and its tool calls. `allowed`: the request's tool names; `choice`: its
    `tool_choice` ('none' parses nothing). Raises `MalformedToolCall` saying what is wrong."""
    if choice == "none" or not allowed:
        return text, []
    calls = []
    for n, match in enumerate(_BLOCK.finditer(text), start=1):
        calls.append(_one_call(match.group(1), n, allowed))
    rest = _BLOCK.sub("", text)
    if OPEN in rest or CLOSE in rest:
        raise MalformedToolCall(f"a {OPEN} without its {CLOSE} (or the reverse) in the reply")
    forced = forced_tool(choice, allowed)
    if choice == "required" and not calls:
        raise MalformedToolCall("tool_choice is 'required' but the reply calls no tool")
    if forced is not None and [c.name for c in calls] != [forced]:
        raise MalformedToolCall(f"tool_choice forces one call of {forced!r}; the reply calls {[c.name for c in calls]}")
    content = rest.strip()
    return (content or None) if calls else text, calls


def _one_call(body: str, n: int, allowed: set[str]) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(
            f"tool call {n} is not JSON ({exc.msg} at character {exc.pos}): {body.strip()!r}"
        ) from exc
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise MalformedToolCall(f'tool call {n} is not {{"name": ..., "arguments": {{...}}}}: {body.strip()!r}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(f"tool call {n} ({name}): its arguments string is not JSON") from exc
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"tool call {n} ({name}): arguments must be an object, not {arguments!r}")
    if name not in allowed:
        raise MalformedToolCall(f"tool call {n} calls {name!r}, which is not among the tools: {sorted(allowed)}")
    return ToolCall(name, arguments)
