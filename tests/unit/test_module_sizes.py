"""Small modules (docs/architecture.md, "Rules that are not imports"): no module of `rollart` is over `LIMIT` lines
unless its docstring has a line saying it is one piece, and why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400


def too_long(root: Path) -> list[str]:
    """Every module over `LIMIT` lines whose docstring has no line starting "One piece:", as `path (N lines)`."""
    found = []
    for path in sorted((root / "rollart").rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("One piece:") for line in doc.splitlines()):
            found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def test_module_sizes_every_long_module_says_why_it_is_one_piece() -> None:
    found = too_long(ROOT)
    assert not found, f"over {LIMIT} lines, split them or say why each is one piece:\n" + "\n".join(found)


def test_module_sizes_check_finds_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "rollart").mkdir()
    body = "\n".join(f"x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "rollart" / "long.py").write_text('"""Long."""\n' + body + "\n")
    (tmp_path / "rollart" / "why.py").write_text('"""Long.\n\nOne piece: a planted reason.\n"""\n' + body + "\n")
    assert too_long(tmp_path) == [f"rollart/long.py ({LIMIT + 1} lines)"]
