"""dataset: bring your own problems, one row of a local JSONL or Parquet file per episode.

    make_env("dataset", path="examples/datasets/arithmetic.jsonl", template="{question}", answer_field="answer")

The file is read with the `datasets` library (`load_dataset("json" | "parquet", data_files=path)`),
never from a hub: `HF_DATASETS_OFFLINE=1` is set unless the environment says otherwise, and the
Arrow cache goes to a temporary directory that is removed once the rows are in memory. It is read
once per process and kept, keyed by its path, modification time and size (an env is made per
trajectory; a file changed in place is read again); its splits are kept the same way.

Each row is a problem: the prompt is a field of it (`prompt_field`, default "question") or a
`str.format` template over its fields ("Solve: {question}"), and the reference answer is
`answer_field` (default "answer"), which every row must have: its text, or JSON for a value that
is neither a string nor a number (a list of tests for the `code_tests` reward, docs/rewards.md).
The rows split into `train` and `heldout` by a hash of each row's index and `split_seed`
(`held_out`): the two never share a row, and every process, on any host, splits a file the same
way. `heldout_fraction` of the rows (about: each row is held out with that chance) or exactly
`heldout_size` of them go to `heldout`.

One turn. `reset(seed)` takes a row of the split from the seed: consecutive seeds walk the split
in an order shuffled by `split_seed`, each row once per `len(split)` seeds, and the same seed gives
the same row. `step(reply)` ends the episode with the reference in `info["answer"]` (what the
task's reward function compares the reply with: `math_verify`, docs/rewards.md) and a quick check
of its own in `info["success"]` and the env's reward (1.0 or 0.0): the reply's last `\\boxed{...}`,
or the whole reply without one, equals the reference as text or as the same rational number
("0.5" and "1/2"). The check is standard-library only; grading math (fractions in LaTeX, sets,
equations) is the reward's job. Every mistake in the arguments or the file is a `ConfigError` when
the env is made (the env-host makes one of each task at start): a missing file, an unknown field,
an empty split, rows without an answer.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import string
import tempfile
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from rollart.envs.answers import last_boxed
from rollart.envs.base import Env, Info, StepResult, not_running, require, resolve_seed
from rollart.errors import ConfigError

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""The `datasets` builder that reads each file suffix."""
Split = Literal["train", "heldout"]
NAME = "dataset"


@dataclass(frozen=True)
class _File:
    """A file as read: the stamp it was read at, and its rows (a `datasets.Dataset` held in memory)."""

    stamp: tuple[int, int]
    rows: Any
    columns: tuple[str, ...]


@dataclass(frozen=True)
class _Split:
    """The rows of one split, in the order consecutive seeds take them, with their reference answers."""

    rows: tuple[int, ...]
    answers: tuple[str, ...]


_lock = threading.Lock()  # envs are made in the env-host's threads, many at once
_files: dict[Path, _File] = {}
_splits: dict[tuple[Any, ...], _Split] = {}


def held_out(index: int, split_seed: int) -> float:
    """Row `index`'s place in [0, 1) for the split: a hash, so the same in every process (not `hash()`)."""
    digest = hashlib.blake2b(f"{split_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def quick_match(given: str, reference: str) -> bool:
    """Whether `given` is `reference`: the same text once spaces, `$` and a final period are trimmed,
    or the same rational number ("0.5", "1/2")."""
    a, b = _trim(given), _trim(reference)
    if a == b:
        return a != ""
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return False


def answer_text(value: Any) -> str:
    """A row's answer as the reference text: a string stripped, a number as its plain text (12 -> "12"),
    anything else (a list, an object, a bool) as JSON, which a reward such as `code_tests` parses;
    a value JSON has no form for (a Parquet timestamp) as its text within the JSON."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, default=str)


def _trim(text: str) -> str:
    return text.strip().strip("$").strip().removesuffix(".").strip()


def _fail(message: str) -> ConfigError:
    return ConfigError(f"env {NAME!r}: {message}")


def _field(kind: str, name: str, file: _File, path: Path) -> None:
    if name not in file.columns:
        close = difflib.get_close_matches(name, file.columns, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise _fail(f"{kind} {name!r} is not a field of {path}.{hint} Its fields: {', '.join(file.columns)}")


def _template_fields(template: str) -> list[str]:
    """The row fields a template names ("{a.b[0]}" names "a"); `ConfigError` for positional ones."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise _fail(f"template {template!r} is not a str.format template: {exc}") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise _fail(f"template {template!r}: name each field, as in {{question}}; got {{{name}}}")
        fields.append(root)
    return fields


def _resolve(path: str | os.PathLike[str]) -> tuple[Path, tuple[int, int]]:
    where = Path(path).expanduser()
    absolute = where if where.is_absolute() else Path.cwd() / where
    try:
        stat = absolute.stat()
    except OSError as exc:
        raise _fail(
            f"cannot read {str(path)!r} (at {absolute}): {exc.strerror}; a relative path is taken from the working"
            " directory, and env workers in a sandbox start in their scratch directory: give an absolute path there"
        ) from None
    if absolute.suffix not in BUILDERS:
        raise _fail(f"{absolute}: expected a file ending in {', '.join(BUILDERS)}")
    return absolute, (stat.st_mtime_ns, stat.st_size)


def _read(path: Path, stamp: tuple[int, int]) -> _File:
    """The file's rows through `datasets`, offline, with its cache in a directory removed afterwards."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by `datasets` when first imported
    import datasets  # type: ignore[import-untyped]  # ~1 s: only where a dataset env is made

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a progress bar per file read would land in the node's log
    try:
        with tempfile.TemporaryDirectory(prefix="rollart-dataset-") as cache:
            rows = datasets.load_dataset(
                BUILDERS[path.suffix], data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
    except Exception as exc:
        # Whatever the reader says about a malformed file is a configuration problem: reported, with the file named.
        raise _fail(f"cannot read {path} as {BUILDERS[path.suffix]}: {type(exc).__name__}: {exc}") from exc
    finally:
        if bars:
            datasets.enable_progress_bars()
    if len(rows) == 0:
        raise _fail(f"{path} has no rows")
    return _File(stamp, rows, tuple(rows.column_names))


def _load(path: str | os.PathLike[str]) -> tuple[Path, _File]:
    """The file at `path`, read once per process and again when its modification time or size changes."""
    absolute, stamp = _resolve(path)
    with _lock:
        file = _files.get(absolute)
        if file is None or file.stamp != stamp:
            file = _files[absolute] = _read(absolute, stamp)
            for stale in [key for key in _splits if key[0] == absolute and key[1] != stamp]:
                del _splits[stale]
        return absolute, file


def _missing(file: _File, fields: list[str]) -> tuple[int, int, str] | None:
    """(rows without it, the first such row, the field) for the first of `fields` some row lacks; None if none does."""
    for name in fields:
        empty = [i for i, value in enumerate(file.rows[name][:]) if value is None or str(value).strip() == ""]
        if empty:
            return len(empty), empty[0], name
    return None


@dataclass(frozen=True)
class _Choice:
    """Which rows an env takes and what it reads of them: the key of a file's split in the cache."""

    answer_field: str
    prompt_fields: tuple[str, ...]
    split: Split
    heldout_size: int | None
    heldout_fraction: float
    split_seed: int


def _split(path: Path, file: _File, choice: _Choice) -> _Split:
    """The rows `choice` takes of `file`, checked: each has an answer and its prompt fields; there are some."""
    key = (path, file.stamp, choice)
    with _lock:
        found = _splits.get(key)
    if found is not None:
        return found
    missing = _missing(file, [choice.answer_field, *choice.prompt_fields])
    if missing is not None:
        count, first, name = missing
        raise _fail(f"{count} of {len(file.rows)} rows of {path} have no {name!r} (the first: row {first})")
    n, seed, size = len(file.rows), choice.split_seed, choice.heldout_size
    if size is None:
        heldout = {i for i in range(n) if held_out(i, seed) < choice.heldout_fraction}
    else:
        heldout = set(sorted(range(n), key=lambda i: held_out(i, seed))[:size])
    rows = [i for i in range(n) if (i in heldout) == (choice.split == "heldout")]
    if not rows:
        how = f"heldout_size={size}" if size is not None else f"heldout_fraction={choice.heldout_fraction}"
        raise _fail(f"the {choice.split!r} split of {path} is empty ({n} rows, {how}, split_seed={seed})")
    random.Random(seed).shuffle(rows)
    answers = file.rows[choice.answer_field][:]  # a list (indexing the column goes row by row)
    made = _Split(tuple(rows), tuple(answer_text(answers[i]) for i in rows))
    with _lock:
        _splits[key] = made
    return made


class DatasetEnv(Env):
    """One row of a local JSONL or Parquet file per episode: its prompt, then one answer, checked."""

    name = NAME
    profile = "decode-heavy"
    max_turns = 1
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        path: str,
        prompt_field: str | None = None,
        template: str | None = None,
        answer_field: str = "answer",
        split: Split = "train",
        heldout_fraction: float = 0.1,
        heldout_size: int | None = None,
        split_seed: int = 0,
    ) -> None:
        require(split in ("train", "heldout"), self.name, f"split must be 'train' or 'heldout', got {split!r}")
        require(0.0 <= heldout_fraction < 1.0, self.name, f"need 0 <= heldout_fraction < 1, got {heldout_fraction}")
        require(heldout_size is None or heldout_size >= 0, self.name, f"need heldout_size >= 0, got {heldout_size}")
        require(prompt_field is None or template is None, self.name, "give prompt_field or template, not both")
        self.path, file = _load(path)
        self.template = template
        self.prompt_field = prompt_field or "question"
        _field("answer_field", answer_field, file, self.path)
        prompt_fields = [self.prompt_field] if template is None else _template_fields(template)
        for name in prompt_fields:
            _field("prompt_field" if template is None else "template field", name, file, self.path)
        self._rows = file.rows
        choice = _Choice(answer_field, tuple(prompt_fields), split, heldout_size, heldout_fraction, split_seed)
        self._split = _split(self.path, file, choice)
        self.split = split
        self._row: int | None = None
        self._answer = ""
        self.prompt(self._split.rows[0])  # a template that fails on a row fails here, not in a trajectory

    def __len__(self) -> int:
        """The rows of this env's split."""
        return len(self._split.rows)

    def prompt(self, row: int) -> str:
        """The observation for file row `row`: its prompt field, or the template over its fields."""
        values = self._rows[row]
        if self.template is None:
            return str(values[self.prompt_field])
        try:
            return self.template.format(**values)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
            raise _fail(
                f"template {self.template!r} on row {row} of {self.path}: {type(exc).__name__}: {exc}"
            ) from None

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode_seed = resolve_seed(seed)
        at = episode_seed % len(self._split.rows)
        self._row, self._answer = self._split.rows[at], self._split.answers[at]
        return self.prompt(self._row), {"seed": episode_seed, "row": self._row, "split": self.split}

    def sample_action(self, rng: random.Random) -> str | None:
        """Some row's answer, drawn at random: a reply of the right form that knows nothing of the problem."""
        return rng.choice(self._split.answers) if self._row is not None else None

    def step(self, action: str) -> StepResult:
        if self._row is None:
            raise not_running(self.name)
        row, self._row = self._row, None
        boxed = last_boxed(action)
        success = quick_match(action if boxed is None else boxed, self._answer)
        info: Info = {"answer": self._answer, "success": success, "boxed": boxed is not None, "row": row, "turn": 1}
        return f"The answer is {self._answer}.", float(success), True, False, info
