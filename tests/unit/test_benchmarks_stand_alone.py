"""Benchmarks run from the package alone: none imports the test tree (`tests/` need not be on disk where a
benchmark runs; what both need is in `rollart.testkit`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_of_tests(root: Path) -> list[str]:
    """Every import of `tests` (or a module under it) in `benchmarks/`, as `file:line module`."""
    found = []
    for path in sorted((root / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"]
    return found


def test_benchmarks_import_nothing_from_the_tests() -> None:
    found = imports_of_tests(ROOT)
    assert not found, "benchmarks import the test tree (move what they share to rollart/testkit):\n" + "\n".join(found)


def test_the_check_finds_a_planted_import(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text("import json\nfrom tests.batches import Seq\n")
    assert imports_of_tests(tmp_path) == ["benchmarks/b.py:2 tests.batches"]
