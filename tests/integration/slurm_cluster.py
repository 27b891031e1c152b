"""A real Slurm cluster of four emulated nodes on this machine, for the Slurm tests.

munged, slurmctld and four slurmd (`-N n1` ... `-N n4`) run as plain background processes with a
private configuration (`SLURM_CONF`), state and logs in one folder; `stop()` ends them and
removes their pid files. Needs root and Debian's slurm-wlm and munge (bin/setup-system-tests)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support import free_ports, wait_for

NODES = ("n1", "n2", "n3", "n4")
"""The components of a heterogeneous job never share a node, and `rollart slurm` makes one per role
group: four for a topology with every role."""
CPUS_PER_NODE = 4
"""More than this machine has: slurmd is told to trust the configuration (config_overrides)."""
KILL_WAIT_S = 30
"""Between the SIGTERM of scancel and the SIGKILL: longer than the test topologies' drain_timeout_s."""


def missing() -> str | None:
    """Why the cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd, munged)"
    tools = [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(t) is None]
    if tools:
        return f"Slurm is not installed ({', '.join(tools)} missing): run bin/setup-system-tests"
    return None


class LocalSlurm:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge", "logs"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ctld, *slurmd = free_ports(1 + len(NODES))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
            "RealMemory=4000 State=UNKNOWN"
            for name, port in zip(NODES, slurmd, strict=True)
        )
        self.conf.write_text(
            f"""ClusterName=rollart-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
AuthType=auth/munge
AuthInfo=socket={f}/munge/munge.socket.2
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool/%n
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f}/logs/slurmctld.log
SlurmdLogFile={f}/logs/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT_S}
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        munge = f / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge}/munge.socket.2",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
                f"--key-file={key}",
            ]
        )
        wait_for((munge / "munge.socket.2").exists, 10, "munged's socket")
        self._spawn(["slurmctld", "-D", "-i"])
        for name in NODES:
            self._spawn(["slurmd", "-D", "-N", name])
        wait_for(self.idle, 60, "every Slurm node idle")

    def _spawn(self, command: list[str]) -> None:
        with (self.folder / "logs" / f"{command[0]}.out").open("ab") as log:  # the child keeps its own copy
            self.procs.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def idle(self) -> bool:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split()
        return out.count("idle") == len(NODES)

    def run(self, *command: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def sbatch(self, script: Path) -> str:
        out = self.run("sbatch", "--parsable", str(script), check=True).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of the job's first component, as key -> value."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()
        fields: dict[str, str] = {}
        for token in (out[0] if out else "").split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job has ended; its fields then."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

        def done() -> dict[str, str] | None:
            job = self.job(job_id)
            return job if job.get("JobState") in ended else None

        return wait_for(done, timeout, f"Slurm job {job_id} to end")  # type: ignore[no-any-return]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for pid_file in self.folder.glob("*.pid"):
            pid_file.unlink()
