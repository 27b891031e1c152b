"""Which GPUs each node of a one-machine run sees: the local launcher's `CUDA_VISIBLE_DEVICES`.

Every node of `rollart run` runs on this machine, whatever its `host` says, so the launcher places
them all on its GPUs with `rollart.topology.gpus.plan_gpus(one_host=True)`: a node's `gpu_ids`, else
the next free ones in topology order. A node with GPUs gets `CUDA_VISIBLE_DEVICES` set to its
devices (so inside it they are cuda:0 .. cuda:N-1, and an fsdp2 trainer's rank r takes cuda:r); a
node without gets `CUDA_VISIBLE_DEVICES=""` and sees none (a trainer with `device: auto` then trains
on CPU, as its `gpus: 0` says).

The machine's GPUs are read without torch: the `CUDA_VISIBLE_DEVICES` the launcher itself was
given, when set (the topology's ids then index into that list, so a launcher confined to GPUs 4-7
puts `gpu_ids: [0]` on GPU 4); else `nvidia-smi -L`; else the driver's /proc/driver/nvidia/gpus/;
else none. A topology that asks for more than the machine has is refused before any node starts,
naming the first node that does not fit (`GpuPlacement.check`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

from rollart.errors import ConfigError
from rollart.topology import Topology
from rollart.topology.gpus import id_list, plan_gpus

ENV = "CUDA_VISIBLE_DEVICES"
PROC_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclasses.dataclass(frozen=True)
class HostGpus:
    """This machine's GPUs as `CUDA_VISIBLE_DEVICES` entries, and how they were found."""

    devices: tuple[str, ...]
    found_by: str


def host_gpus(environ: dict[str, str] | None = None, proc: Path = PROC_GPUS) -> HostGpus:
    """The GPUs this process may use (module docstring), without importing torch."""
    environ = dict(os.environ) if environ is None else environ
    if ENV in environ:
        devices = tuple(d.strip() for d in environ[ENV].split(",") if d.strip())
        return HostGpus(devices, f"{ENV}={environ[ENV]!r}")
    if (smi := shutil.which("nvidia-smi")) is not None:
        try:
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            listing = None
        if listing is not None:  # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)"; MIG devices are indented below
            count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
            return HostGpus(tuple(str(i) for i in range(count)), "nvidia-smi -L")
    try:
        count = sum(1 for _ in proc.iterdir())
    except OSError:
        return HostGpus((), "no nvidia-smi and no NVIDIA driver")
    return HostGpus(tuple(str(i) for i in range(count)), str(proc))


@dataclasses.dataclass(frozen=True)
class GpuPlacement:
    """Each node's GPU ids (indices into `host.devices`) on this machine."""

    ids: dict[str, tuple[int, ...]]
    host: HostGpus

    def env_for(self, node: str) -> dict[str, str]:
        """What to add to a node's environment: its devices, or none."""
        ids = self.ids.get(node, ())
        return {ENV: ",".join(self.host.devices[i] for i in ids)}

    def describe(self) -> str:
        """One line for the launcher to print: who runs on which GPUs ("" on a machine without any, where
        no node asks for one)."""
        placed = ", ".join(f"{name} {id_list(ids)}" for name, ids in self.ids.items() if ids)
        if not placed and not self.host.devices:
            return ""
        have = f"{len(self.host.devices)} GPU(s) ({self.host.found_by})"
        return f"gpus: {have}: {placed}; the other nodes see none" if placed else f"gpus: {have}, no node uses one"

    def check(self, topology: Topology) -> None:
        """Refuse a plan that needs a GPU beyond the machine's: ConfigError naming the YAML path of the
        first node that does not fit, before any node starts."""
        count = len(self.host.devices)
        for i, node in enumerate(topology.nodes):
            ids = self.ids.get(node.name, ())
            if ids and max(ids) >= count:
                asked = sum(other.resources.gpus for other in topology.nodes)
                key = "gpu_ids" if node.resources.gpu_ids is not None else "gpus"
                raise ConfigError(
                    f"{topology.source}: nodes[{i}].resources.{key}: node {node.name} needs GPU(s) {id_list(ids)} "
                    f"of this machine, which has {count} ({self.host.found_by}); the topology asks for {asked} "
                    "in all: run it where the GPUs are (rollart slurm), or lower resources.gpus"
                )


def place_gpus(topology: Topology, host: HostGpus | None = None) -> GpuPlacement:
    """The placement of `topology`'s nodes on this machine's GPUs (`host`: found here when None), not yet
    checked against them (`GpuPlacement.check`)."""
    return GpuPlacement(plan_gpus(topology, one_host=True), host_gpus() if host is None else host)
