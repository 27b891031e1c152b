"""Which part of `rollart` may import which (docs/architecture.md), checked by walking every import with `ast`.

Every `import` and `from ... import` in every module counts, at any depth (a deferred import inside a
function is still a dependency) and under `if TYPE_CHECKING:` too (a layer that names another's types
knows it). Relative imports are resolved against the module's package. The rule table below is the one
docs/architecture.md draws; change both together.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rollart"

# Every part of the package: a subpackage or a top-level module, by its first name under `rollart.`.
# Each may import the parts listed (and itself); anything else of rollart is a broken rule.
LEAVES = {"errors", "clock", "logs"}
RULES: dict[str, set[str]] = {
    # the leaves: anyone may import them; they import nothing of rollart (but one another's errors)
    "errors": set(),
    "clock": set(),
    "logs": set(),
    # the wire knows no roles
    "protocol": set(),
    # pure code over plain data: no network, no nodes, no engines
    "algorithms": set(),
    # model folders and shapes: config.json, generation config, presets, the test model's recipe
    "models": set(),
    "envs": set(),
    # worker processes for untrusted code: spawn, limits, sandbox, framing; nothing of the rest
    "workers": set(),
    "tasks": {"envs"},
    "rewards": {"envs", "workers"},
    # modelled hardware, links and reward service for the simulation mode
    "sim": {"envs", "rewards"},
    # running env calls in threads and worker processes (`workers`: spawn, limits, sandbox, framing)
    "envexec": {"envs", "tasks", "workers"},
    # LoRA settings and PEFT's adapter format: shared by training and generation, it imports neither
    "lora": set(),
    # training engines are driven by their node: no nodes, no protocol, no rollout, no generation (`weights`: the
    # weight settings `run.trainer` holds, the bucket size an export cuts by)
    "training": {"algorithms", "models", "lora", "weights", "shm"},
    # generation engines likewise, and generation never imports training (`sim`: the simulated engine's model)
    "generation": {"models", "lora", "sim", "cpus", "shm"},
    # the weight path: the wire and the bulk transfer
    "weights": {"protocol", "shm"},
    # the training steps' records (metrics, timeline, utilization: of trajectories and peers' status, protocol
    # messages) and the experiment trackers (TensorBoard, W&B, MLflow) fed the metrics lines, into the run folder
    "tracking": {"rundir", "protocol"},
    # trajectory coroutines, routing, buffers: other nodes only through protocol sessions, never an engine
    "rollout": {"protocol", "envs", "envexec", "rewards", "algorithms"},
    # agent programs' episodes: the OpenAI-compatible endpoint and its token record, over rollout's turn pieces
    "agents": {"protocol", "rollout", "workers"},
    # the typed topology: no torch, no nodes
    "topology": {
        "protocol",
        "rollout",
        "envs",
        "envexec",
        "rewards",
        "training",
        "generation",
        "sim",
        "algorithms",
        "models",
        "tracking",
    },
    "plugins": {"envs", "rewards"},
    # the tiny model and its warm-up: a recipe over models, envs, tasks and rollout
    "tiny": {"envs", "tasks", "rollout", "algorithms", "models"},
    # the daemons put the parts together
    "nodes": set(),  # every part of a run (filled in below, from ROWS)
    "rundir": set(),
    "step_times": set(),
    "cpus": set(),
    # shared memory that other processes map: weights staged once per host
    "shm": set(),
    "node": {"nodes", "topology", "plugins", "cpus", "workers", "generation"},
    "report": {"rundir", "topology", "step_times"},
    # starting runs: the top, beside the CLI
    "launch": {
        "protocol",
        "nodes",
        "node",
        "topology",
        "tiny",
        "rundir",
        "report",
        "step_times",
        "cpus",
        "plugins",
        "sim",
        "envs",
        "rewards",
        "models",
        "generation",
    },
    "admin_cli": {"protocol", "topology", "rundir"},
    # `rollart export` reads a checkpoint with the training code that wrote it; `run` asks a generation backend's
    # record where its library lives
    "cli": {
        "launch",
        "topology",
        "report",
        "admin_cli",
        "tiny",
        "rundir",
        "protocol",
        "training",
        "generation",
        "models",
    },
    "__main__": {"cli"},
    "__init__": set(),
    # tools for testing a deployment (fault injection, topology building): imports anything, imported by nothing
    "testkit": set(),  # anything a deployment has (filled in below, from ROWS); nothing imports it
}

# The rows of docs/architecture.md's picture: a part imports only parts on lower rows.
ROWS: dict[str, int] = {
    **dict.fromkeys(["errors", "clock", "logs"], -1),
    **dict.fromkeys(
        [
            "protocol",
            "algorithms",
            "models",
            "envs",
            "workers",
            "rundir",
            "step_times",
            "cpus",
            "shm",
            "lora",
            "__init__",
        ],
        0,
    ),
    **dict.fromkeys(["tasks", "rewards", "weights", "tracking"], 1),
    **dict.fromkeys(["training", "envexec", "sim", "plugins"], 2),
    **dict.fromkeys(["rollout", "generation"], 3),
    **dict.fromkeys(["topology", "tiny", "agents"], 4),
    "nodes": 5,
    **dict.fromkeys(["node", "report"], 6),
    **dict.fromkeys(["launch", "admin_cli"], 7),
    **dict.fromkeys(["cli", "testkit"], 8),
    "__main__": 9,
}

RULES["nodes"] = {part for part, row in ROWS.items() if 0 <= row < ROWS["nodes"]} - {"__init__"}
RULES["testkit"] = {part for part, row in ROWS.items() if row >= 0} - {"testkit", "__main__", "__init__"}

# The few imports a rule allows one module, with the reason; each one is drawn in docs/architecture.md.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("rollart.envs.registry", "tasks"): (
        "the registry imports rollart.tasks at its first use so that every built-in name resolves: the built-ins "
        "register as a user's env module does; no other module of the env API imports a task"
    ),
}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}: {self.why}"


def part_of(module: str) -> str:
    """`rollart.nodes.trainer` -> `nodes`; `rollart.topology` -> `topology`; `rollart` -> `__init__`."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root).with_suffix("")
    names = list(relative.parts)
    if names[-1] == "__init__":
        names = names[:-1] if len(names) > 1 else names
    return ".".join(names)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every rollart module `path` imports, with its line: absolute and relative, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from rollart import launch` imports the part `launch`, not just the package
            if target == PACKAGE:
                found += [(node.lineno, f"{PACKAGE}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def check(root: Path) -> list[Violation]:
    """Walk the package under `root` (the folder holding `rollart/`) and list every broken rule."""
    violations: list[Violation] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        module = module_name(path, root)
        part = part_of(module)
        if part not in RULES:
            violations.append(Violation(module, 1, "-", f"part '{part}' has no rule: add it to RULES"))
            continue
        allowed = RULES[part] | LEAVES | {part}
        for line, imported in imports_of(path, module):
            target = part_of(imported)
            if imported == PACKAGE:
                continue  # the package itself: its __init__ imports nothing
            if (module, target) in EXCEPTIONS:
                continue
            if target not in allowed:
                violations.append(Violation(module, line, imported, f"'{part}' may not import '{target}'"))
            elif part in LEAVES and target not in (part, "errors"):
                violations.append(Violation(module, line, imported, f"'{part}' is a leaf"))
    return violations


def test_import_rules_hold_for_the_whole_package() -> None:
    violations = check(ROOT)
    assert not violations, "broken import rules (docs/architecture.md):\n" + "\n".join(map(str, violations))


def test_import_rule_checker_fails_on_a_planted_bad_import(tmp_path: Path) -> None:
    """The same walk over a copy of the package with bad imports planted: the protocol importing a role,
    deferred inside a function, the way a shortcut would sneak in; generation importing training; lora importing
    generation, for the type checker only."""
    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    framing = tmp_path / PACKAGE / "protocol" / "framing.py"
    framing.write_text(framing.read_text() + "\n\ndef _shortcut():\n    from rollart.nodes import trainer\n")
    envs_base = tmp_path / PACKAGE / "envs" / "base.py"
    envs_base.write_text(envs_base.read_text() + "\nfrom ..generation.hf import engine  # noqa\n")
    # generation never imports training (its LoRA settings come from `lora`), and lora imports neither
    generation = tmp_path / PACKAGE / "generation" / "engine_set.py"
    generation.write_text(generation.read_text() + "\nfrom rollart.training.spec import TrainerSpec  # noqa\n")
    lora = tmp_path / PACKAGE / "lora" / "spec.py"
    lora.write_text(lora.read_text() + "\nif TYPE_CHECKING:\n    from rollart.generation import engine  # noqa\n")
    violations = {(v.module, v.imported) for v in check(tmp_path)}
    assert violations == {
        ("rollart.protocol.framing", "rollart.nodes"),
        ("rollart.envs.base", "rollart.generation.hf"),
        ("rollart.generation.engine_set", "rollart.training.spec"),
        ("rollart.lora.spec", "rollart.generation"),
    }


def test_an_unknown_part_is_a_broken_rule(tmp_path: Path) -> None:
    (tmp_path / PACKAGE / "newpart").mkdir(parents=True)
    (tmp_path / PACKAGE / "newpart" / "__init__.py").write_text('"""A part nobody placed."""\n')
    assert [v.why for v in check(tmp_path)] == ["part 'newpart' has no rule: add it to RULES"]


@pytest.mark.parametrize("part", sorted(RULES))
def test_every_rule_names_known_parts_on_lower_rows(part: str) -> None:
    assert RULES[part] <= set(RULES), f"{part} names parts that do not exist: {RULES[part] - set(RULES)}"
    upward = {other for other in RULES[part] if ROWS[other] >= ROWS[part] and part != "testkit"}
    assert not upward, f"{part} (row {ROWS[part]}) may import {upward}, not on a lower row"
