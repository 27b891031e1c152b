"""msgspec's validation messages told in the topology file's terms: a YAML path and what was expected.

`explain` reads the path msgspec gives (`$.nodes[2].role`), finds the type declared there, and says
what the file should hold: the allowed values of an enum or Literal, the known keys with a "did you
mean" hint, the YAML name of a kind (mapping, list).
"""

from __future__ import annotations

import difflib
import enum
import re
import types
import typing
from typing import Any, Literal

import msgspec

_MSGSPEC_ERROR = re.compile(
    r"^(?P<msg>.*?)(?: - at `(?P<key>key)` in `\$(?P<kpath>[^`]*)`| - at `\$(?P<path>[^`]*)`)?$"
)
_YAML_KINDS = {"object": "mapping", "array": "list"}
RENAMED = {
    "max_batch_size": "max_num_seqs",
    # run.trainer's weight settings, now one struct (`run.trainer.weights`)
    "weight_transport": "weights.transport",
    "bucket_mb": "weights.bucket_mb",
    "weight_fanout": "weights.fanout",
    "weight_delta": "weights.delta",
    "push_timeout_s": "weights.push_timeout_s",
}
"""Keys an earlier RollArt had under another name: an old file's key is named with its new one (a dotted name:
under the key before the dot, in the same mapping)."""


def explain(message: str, data: Any, root: type[msgspec.Struct]) -> tuple[str, str]:
    """Turn msgspec's message on decoding `data` as `root` into (YAML path, problem) in the file's terms."""
    match = _MSGSPEC_ERROR.match(message)
    assert match is not None  # the pattern's groups are all optional
    msg, path = match["msg"], (match["path"] or match["kpath"] or "").lstrip(".")
    if match["key"]:
        return path, "expected every key to be a string"
    target = _type_at(root, path)
    if (quoted := re.match(r"Object contains unknown field `(.*)`$", msg)) is not None:
        key, problem = quoted[1], f"unknown key {quoted[1]!r}"
        fields = [f.encode_name for f in msgspec.structs.fields(target) if f.name != "source"]
        if (new := RENAMED.get(key)) is not None and new.split(".")[0] in fields:
            moved = f" ({path}.{new})" if "." in new and path else ""
            return path, problem + f"; it is called {new!r} now{moved}"
        hint = difflib.get_close_matches(key, fields, n=1)
        return path, problem + (f"; did you mean {hint[0]!r}?" if hint else "")
    if (quoted := re.match(r"Object missing required field `(.*)`$", msg)) is not None:
        return path, f"missing required key {quoted[1]!r}"
    if (allowed := _choices(target)) is not None:
        return path, f"expected one of {', '.join(allowed)}; got {_value_at(data, path)!r}"
    if (kinds := re.match(r"Expected `(.*)`, got `(.*)`$", msg)) is not None:
        want, got = (_YAML_KINDS.get(kind, kind) for kind in kinds.groups())
        return path, f"expected {want}; got {got}"
    return path, msg[:1].lower() + msg[1:]


def _segments(path: str) -> list[str | int]:
    return [int(index) if index else name for name, index in re.findall(r"(\w+)|\[(\d+)\]", path)]


def _type_at(root: type[msgspec.Struct], path: str) -> Any:
    """The declared type at a YAML path, Optional unwrapped (e.g. `nodes[0].role` is Role)."""
    kind: Any = root
    for segment in _segments(path):
        if isinstance(segment, int):
            (kind,) = typing.get_args(kind)
        else:
            kind = next(f.type for f in msgspec.structs.fields(kind) if f.encode_name == segment)
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return kind


def _value_at(data: Any, path: str) -> Any:
    for segment in _segments(path):
        data = data[segment]
    return data


def _choices(kind: Any) -> list[str] | None:
    """The allowed values of an enum or Literal type, else None."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [str(member.value) for member in kind]
    if typing.get_origin(kind) is Literal:
        return [str(value) for value in typing.get_args(kind)]
    return None
