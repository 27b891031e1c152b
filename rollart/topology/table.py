"""What `rollart check TOPOLOGY` prints: the model, then one row per node, then a note per node.

    model: qwen3-8b: 8.19B parameters, ... (run.model.shape qwen3-8b, no config.json in models/Qwen3-8B yet)

    node      role       host       gpus           per  weights  grads+opt  activ.  kv cache  need  holds       fit
    trainer   trainer    10.0.0.1   0-3 H100 79.6  GPU  3.9      22.9       6.2     -         33.0  71.6 of ..  ok

Memory in GiB, per GPU for nodes with GPUs (`gpus`: the ids the node gets on its host, the kind, GiB
each) and per node for the others; `holds` is the usable part (`rollart.topology.sizing`); `fit` is ok,
NO FIT (the problem follows, as a `ConfigError` line with the YAML path), or - without a verdict (no
model shape, no GPU kind, a CPU node without `memory_gb`). It reads only the topology and the model's
config.json, so it runs on a laptop without GPUs.
"""

from __future__ import annotations

from rollart.topology import Topology
from rollart.topology.fit import NodeSize, size_topology
from rollart.topology.gpus import GIB, id_list
from rollart.topology.weight_path import weight_path_report

COLUMNS = ("node", "role", "host", "gpus", "per", "weights", "grads+opt", "activ.", "kv cache", "need", "holds", "fit")


def check_report(topology: Topology) -> tuple[list[str], list[str]]:
    """The lines `rollart check` prints, and its problems as `{source}: {path}: {problem}` lines."""
    sizing = size_topology(topology)
    if sizing.shape is not None:
        lines = [f"model: {sizing.shape.describe()} (from {sizing.source})"]
    else:
        lines = [f"model: not sized: {sizing.source}"]
    rows = [COLUMNS, *(_row(size) for size in sizing.nodes)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(COLUMNS))]
    lines.append("")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    notes = [(size.node.name, note) for size in sizing.nodes for note in size.notes]
    if notes:
        lines.append("")
        name_width = max(len(name) for name, _ in notes)
        lines += [f"{name.ljust(name_width)}  {note}" for name, note in notes]
    if path := weight_path_report(topology, sizing.shape):
        lines += ["", *path]
    problems = [f"{topology.source}: {path}: {problem}" for path, problem in sizing.problems]
    return lines, problems


def _row(size: NodeSize) -> tuple[str, ...]:
    node = size.node
    return (
        node.name,
        node.role.value,
        node.host,
        _gpus(size),
        size.per if size.need is not None else "-",
        _gib(size.weights),
        _gib(size.grads_optim),
        _gib(size.activations),
        _gib(size.kv),
        _gib(size.need),
        size.usable_text if size.usable is not None else "-",
        size.verdict,
    )


def _gpus(size: NodeSize) -> str:
    if not size.node.resources.gpus:
        return "-"
    memory = f" {size.gpu_gib:.1f}" if size.gpu_gib is not None else ""
    return f"{id_list(size.ids)} {size.kind or '?'}{memory}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"
