"""`rollart slurm` for real: a local Slurm cluster (tests/integration/slurm_cluster.py) runs the
sbatch script it writes for a small training topology (trainer, two generators, an env-host, a
reward gateway: a heterogeneous job of four components).

- the script runs the topology to completion;
- `scancel` drains every node (none killed), the trainer checkpoints what it trained, and the job
  submitted again resumes from there and completes;
- a node killed with kill -9 inside the job is restarted (on-failure) and the run completes;
- under stop-all, the same kill ends the job with an error naming the node;
- a trainer group (a primary and a member trainer node) runs as the trainer component, and only
  the primary's end ends the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollart.rundir import RunDir, read_jsonl
from tests.integration import slurm_cluster
from tests.integration.cluster import HARDWARE, NODES, training_yaml
from tests.support import ROOT, http, node_env, wait_for, write_topology

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
"""Longer than the waits inside a test (step 1 in 240 s, the job's end in 300 s), so that a slow job
fails with the wait's own message and the job's output, not pytest-timeout's stack dump."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.LocalSlurm]:
    if (why := slurm_cluster.missing()) is not None:
        pytest.skip(why)
    cluster = slurm_cluster.LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.env |= node_env()  # the session secret and admin token, exported to the job by sbatch
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class Job:
    """One topology's sbatch script, submitted to the local cluster."""

    def __init__(
        self,
        slurm: slurm_cluster.LocalSlurm,
        folder: Path,
        model: Path,
        steps: int,
        restart: str,
        *,
        nodes: dict[str, str] = NODES,
        fields: dict[str, dict[str, Any]] | None = None,
        trainer: str = "",
    ) -> None:
        self.slurm, self.folder = slurm, folder
        run_yaml = training_yaml(model, steps=steps, checkpoint_every=1, trainer=trainer)
        self.topology, self.ports = write_topology(
            folder, nodes, hardware=HARDWARE, restart=restart, extra_run=run_yaml, fields=fields
        )
        self.run_dir = folder / "run"
        self.script = folder / "job.sbatch"
        made = subprocess.run(
            [sys.executable, "-m", "rollart", "slurm", str(self.topology), "--out", str(self.script)],
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
        )
        assert made.returncode == 0, made.stderr
        self.id = ""

    def submit(self) -> str:
        # The previous test's job may still be completing on its nodes (KillWait): this one would
        # queue behind it, and its own waits would count that time.
        wait_for(self.slurm.idle, slurm_cluster.KILL_WAIT_S + 30, "every Slurm node idle before the job")
        self.id = self.slurm.sbatch(self.script)
        return self.id

    def status(self, name: str) -> dict[str, Any]:
        code, body = http("GET", self.ports[name][1], "/status")
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def wait_steps(self, steps: int, timeout: float) -> None:
        try:
            wait_for(
                lambda: self.status("trainer").get("rollout", {}).get("batches", 0) >= steps, timeout, f"step {steps}"
            )
        except AssertionError as e:
            raise AssertionError(f"{e}; job {self.slurm.job(self.id)}:\n{self.output()[-3000:]}") from None

    def output(self) -> str:
        path = self.run_dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else "(no job output)"

    def end(self, timeout: float = 300) -> dict[str, str]:
        try:
            return self.slurm.wait_job(self.id, timeout)
        except AssertionError:
            self.slurm.run("scancel", self.id)
            raise AssertionError(f"job {self.id} did not end within {timeout} s:\n{self.output()[-3000:]}") from None

    def steps(self) -> list[int]:
        return [line["step"] for line in read_jsonl(RunDir(self.run_dir).metrics) if "step" in line]

    def events(self, name: str, event: str) -> list[str]:
        log = RunDir(self.run_dir).node_log(name)
        return [line for line in log.read_text(errors="replace").splitlines() if f'"event": "{event}"' in line]


def kill_node(job: Job, name: str) -> int:
    pid = int(job.status(name)["pid"])  # one machine: the node's own pid is the host's
    os.kill(pid, signal.SIGKILL)
    return pid


def test_the_sbatch_script_runs_a_short_topology_to_completion(
    slurm: slurm_cluster.LocalSlurm, tmp_path: Path, tiny_model: Path
) -> None:
    job = Job(slurm, tmp_path, tiny_model, steps=3, restart="on-failure")
    script = job.script.read_text()
    assert script.count("#SBATCH hetjob") == 3, script  # four components: one per role group
    for name in NODES:
        assert f"\n{name} " in script, script  # the script's own table
    job.submit()
    ended = job.end()
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), (ended, job.output())
    assert job.steps() == [1, 2, 3]
    out = job.output()
    assert "trainer finished the run" in out, out
    for name in NODES:
        assert job.events(name, "node.stopped"), name  # every node drained, none killed


def test_scancel_drains_every_node_and_the_next_job_resumes(
    slurm: slurm_cluster.LocalSlurm, tmp_path: Path, tiny_model: Path
) -> None:
    job = Job(slurm, tmp_path, tiny_model, steps=5, restart="on-failure")
    job.submit()
    job.wait_steps(2, 240)
    slurm.run("scancel", job.id, check=True)
    ended = job.end()
    assert ended["JobState"] == "CANCELLED", ended
    for name in NODES:
        assert job.events(name, "node.drain_requested") and job.events(name, "node.stopped"), name
    trained = job.steps()
    latest = RunDir(job.run_dir).latest_step()
    assert latest == trained[-1], (latest, trained)  # every trained step kept

    job.submit()
    ended = job.end()
    assert ended["JobState"] == "COMPLETED", (ended, job.output())
    resumed = job.steps()[len(trained) :]
    assert resumed == list(range(trained[-1] + 1, 6)), (trained, resumed)


def test_a_node_killed_inside_the_job_is_restarted_and_the_run_completes(
    slurm: slurm_cluster.LocalSlurm, tmp_path: Path, tiny_model: Path
) -> None:
    job = Job(slurm, tmp_path, tiny_model, steps=4, restart="on-failure")
    job.submit()
    job.wait_steps(1, 240)
    killed = kill_node(job, "env-0")
    wait_for(lambda: job.status("env-0")["pid"] != killed, 120, "env-0 restarted")
    ended = job.end()
    assert ended["JobState"] == "COMPLETED", (ended, job.output())
    assert job.steps() == [1, 2, 3, 4]
    assert "node env-0" in job.output() and "restart policy on-failure" in job.output(), job.output()


def test_under_stop_all_a_killed_node_fails_the_job_naming_it(
    slurm: slurm_cluster.LocalSlurm, tmp_path: Path, tiny_model: Path
) -> None:
    job = Job(slurm, tmp_path, tiny_model, steps=50, restart="stop-all")
    job.submit()
    job.wait_steps(1, 240)
    kill_node(job, "gen-compute")
    ended = job.end()
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "1:0"), (ended, job.output())
    out = job.output()
    assert "rollart slurm: node gen-compute" in out and "restart policy stop-all" in out, out
    for name in set(NODES) - {"gen-compute"}:
        assert job.events(name, "node.stopped"), name  # the others drained


def test_trainer_group_is_one_component_and_its_primary_ends_the_job(
    slurm: slurm_cluster.LocalSlurm, tmp_path: Path, tiny_model: Path
) -> None:
    nodes = NODES | {"trainer-b": "trainer"}
    fields = {"trainer": {"rendezvous": True}, "trainer-b": {"primary": "trainer"}}
    job = Job(
        slurm, tmp_path, tiny_model, steps=2, restart="on-failure", nodes=nodes, fields=fields, trainer="backend: fsdp2"
    )
    script = job.script.read_text()
    assert script.count("#SBATCH hetjob") == 3 and "component 0: trainer (2 nodes of one trainer group)" in script, (
        script
    )
    job.submit()
    ended = job.end()
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), (ended, job.output())
    assert job.steps() == [1, 2]
    out = job.output()
    assert "trainer finished the run" in out and "trainer-b finished" not in out, out
    for name in nodes:
        assert job.events(name, "node.stopped"), name
    assert not job.events("trainer-b", "ranks.group_failed")
