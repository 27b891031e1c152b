"""A generation backend is asked, not named: outside the registry and the config struct, no code of `rollart` holds
a generator backend's name as a string (docs/architecture.md). Code that needs to know what a backend can do asks
its record (`rollart.generation.registry.GENERATION_BACKENDS`), so a new backend touches one file, not eight."""

from __future__ import annotations

import ast
from pathlib import Path

from rollart.generation.registry import GENERATION_BACKENDS

ROOT = Path(__file__).resolve().parents[2]
WHERE_NAMED = {"rollart/generation/registry.py", "rollart/generation/config.py"}
"""The registry's records and `GeneratorSpec.backend`'s type."""
OTHER_MEANINGS: dict[tuple[str, str], str] = {
    ("rollart/tasks/__init__.py", "sim"): "the simulated environment's name, registered as an env",
    ("rollart/tasks/sim.py", "sim"): "the simulated environment's name",
    ("rollart/testkit/outcome.py", "hf"): "a test scenario's default engine, written into the topology it builds",
}
"""(file, string) -> why that string there is not code that names a backend."""


def named_backends(root: Path) -> list[str]:
    """Every string constant of `rollart` that is a generator backend's name, as `file:line 'name'`, outside
    `WHERE_NAMED` and `OTHER_MEANINGS`."""
    found = []
    for path in sorted((root / "rollart").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative in WHERE_NAMED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=relative)):
            named = isinstance(node, ast.Constant) and node.value in GENERATION_BACKENDS
            if named and (relative, node.value) not in OTHER_MEANINGS:
                found.append(f"{relative}:{node.lineno} {node.value!r}")
    return found


def test_backend_names_appear_only_in_the_generation_registry_and_config() -> None:
    found = named_backends(ROOT)
    assert not found, "a generator backend named outside the registry (ask its record instead):\n" + "\n".join(found)


def test_backend_names_check_finds_a_planted_comparison(tmp_path: Path) -> None:
    (tmp_path / "rollart" / "nodes").mkdir(parents=True)
    (tmp_path / "rollart" / "nodes" / "x.py").write_text('def f(run):\n    return run.generator.backend == "vllm"\n')
    assert named_backends(tmp_path) == ["rollart/nodes/x.py:2 'vllm'"]
