"""A reward gateway shared by several training runs (Reward-as-a-Service shared by jobs): each run's
env-hosts reach another topology's gateway (`run.reward_service`) with the secret it knows that run
by (`run.reward_pool.jobs`); the gateway shares its workers fairly and counts each run apart.

In-process on a virtual clock (two simulated runs and the service), and over loopback TCP with real
node processes (`slow`: two small training runs and the service, each launched by `rollart run`)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from rollart.errors import ConfigError
from rollart.launch.inprocess import run_inprocess_jobs
from rollart.protocol.auth import Identity, client_handshake
from rollart.protocol.errors import HandshakeRefused
from rollart.protocol.framing import open_tcp
from rollart.rundir import RunDir, read_jsonl
from rollart.topology import Topology, load_topology, parse_topology
from tests.integration.cluster import training_yaml
from tests.integration.test_launcher import launch
from tests.integration.test_sim_mode import sim_yaml
from tests.integration.test_tls import SECRET, tls_server
from tests.support import healthy, http, wait_for, write_topology

pytestmark = pytest.mark.integration

SERVICE_PORT = 21000
REWARD = {"placement": "service", "workers": 2, "cold_start_s": 5.0, "idle_timeout_s": 30.0}


def job_topology(folder: Path, name: str, port: int, model: Path) -> Topology:
    """A simulated run whose env-host uses the shared gateway at `SERVICE_PORT`, its nodes from `port` on."""
    run = sim_yaml(model, speedup=1.0, sim_extra="\n    trainer: {gpu: H800, gpus: 8}")
    run += f"  name: {name}\n  run_dir: {folder / name}\n  drain_timeout_s: 5\n"
    run += f"  reward_service: {{port: {SERVICE_PORT}}}\n"
    nodes = [("trainer", "trainer", "cpu"), ("gen-compute", "generator", "compute")]
    nodes += [("gen-bandwidth", "generator", "bandwidth"), ("env-0", "env-host", "cpu")]
    listed = [
        {"name": node, "role": role, "hardware": hardware, "port": port + 2 * i, "admin_port": port + 2 * i + 1}
        for i, (node, role, hardware) in enumerate(nodes)
    ]
    path = folder / f"{name}.yaml"
    path.write_text("run:\n" + run + yaml.safe_dump({"nodes": listed}, sort_keys=False))
    return load_topology(path)


def service_topology(folder: Path, model: Path, jobs: dict[str, float]) -> Topology:
    listed = [{"name": job, "secret_env": f"SECRET_{i}", "weight": w} for i, (job, w) in enumerate(jobs.items())]
    spec = {
        "run": {
            "name": "reward-service",
            "run_dir": str(folder / "service"),
            "model": {"path": str(model)},
            "generator": {"backend": "sim"},
            "sim": {"model": "qwen3-8b", "engines": {"compute": {"gpu": "H800", "gpus": 1}}, "reward": REWARD},
            "reward_pool": {"jobs": listed},
        },
        "nodes": [{"name": "reward", "role": "reward-gateway", "port": SERVICE_PORT, "admin_port": SERVICE_PORT + 1}],
    }
    path = folder / "service.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return load_topology(path)


@pytest.mark.timeout(300)
def test_two_runs_share_one_reward_gateway_fairly_in_process(tmp_path: Path) -> None:
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    jobs = [job_topology(tmp_path, name, port, model) for name, port in (("job-a", 20000), ("job-b", 20100))]
    service = service_topology(tmp_path, model, {"job-a": 1.0, "job-b": 1.0})
    runs, stats = run_inprocess_jobs(jobs, service, log=tmp_path / "nodes.log")
    assert stats is not None
    for name, run in zip(("job-a", "job-b"), runs, strict=True):
        assert [batch.version for batch in run.batches] == [0, 1, 2, 3]  # each run trained all its batches
        scored = sum(batch.trajectories for batch in run.batches)
        # every trajectory of its batches was scored by the shared gateway, counted as this run's
        assert stats.jobs[name].served >= scored
        assert stats.jobs[name].failed == 0
    assert stats.jobs.keys() == {"job-a", "job-b"}
    shares = [stats.jobs[name].share for name in ("job-a", "job-b")]
    assert sum(shares) == pytest.approx(1.0) and min(shares) > 0.3  # the same work each: about half
    assert stats.peak_workers <= 2 and stats.utilization > 0


def test_a_run_not_served_or_misconfigured_is_named(tmp_path: Path) -> None:
    from rollart.tiny.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", seed=0)
    job = job_topology(tmp_path, "job-c", 20200, model)
    service = service_topology(tmp_path, model, {"job-a": 1.0})
    with pytest.raises(ConfigError, match=r"its job 'job-c' is not in run.reward_pool.jobs"):
        run_inprocess_jobs([job], service)


def test_topology_checks_of_a_shared_gateway() -> None:
    both = """
run: {reward_service: {port: 7300}}
nodes:
  - {name: env-0, role: env-host, port: 7100, admin_port: 7200}
  - {name: reward, role: reward-gateway, port: 7101, admin_port: 7201}
"""
    with pytest.raises(ConfigError, match=r"nodes\[1\].role: this run uses the shared gateway"):
        parse_topology(both)
    jobs = """
run:
  name: svc
  reward_pool: {jobs: [{name: svc, secret_env: A}, {name: b}, {name: c, secret_env: C, weight: 0}]}
nodes:
  - {name: reward, role: reward-gateway, port: 7101, admin_port: 7201}
"""
    with pytest.raises(ConfigError) as caught:
        parse_topology(jobs)
    message = str(caught.value)
    assert "run.reward_pool.jobs[0].name: 'svc' is this run's own name" in message
    assert "run.reward_pool.jobs[1]: expected one of secret_env or secret_file" in message
    assert "run.reward_pool.jobs[2].weight: expected a value > 0" in message


async def _handshake(port: int, node: str, role: str, secret: bytes) -> str:
    """Connect as `node` (`role`) proving `secret`; "welcome", or why it was refused."""
    conn = await open_tcp("127.0.0.1", port, max_frame_bytes=2**20, max_bulk_bytes=2**20, timeout=5)
    try:
        await client_handshake(conn, identity=Identity(node, role), secret=secret, session_id=node, timeout=5)
    except HandshakeRefused as exc:
        return exc.reason
    finally:
        conn.close()
    return "welcome"


@pytest.mark.timeout(30)
async def test_another_runs_env_host_proves_its_own_secret_and_nothing_else_gets_in(free_port: int) -> None:
    roles = {"env-0": "env-host", "gen-0": "generator"}
    async with tls_server(free_port, None, roles=roles, jobs={"job-a": b"secret-a"}) as server:
        assert await _handshake(free_port, "job-a/env-0", "env-host", b"secret-a") == "welcome"
        assert "wrong shared secret" in await _handshake(free_port, "job-a/env-0", "env-host", SECRET)
        assert "is no env-host of a job" in await _handshake(free_port, "job-x/env-0", "env-host", b"secret-a")
        assert "is no env-host of a job" in await _handshake(free_port, "job-a/gen-0", "generator", b"secret-a")
        # the server's own run is unchanged: its nodes prove its own secret, and are what its topology says
        assert await _handshake(free_port, "env-0", "env-host", SECRET) == "welcome"
        assert "is no trainer" in await _handshake(free_port, "gen-0", "trainer", SECRET)
        assert server.refusals == 4


def real_run_topology(folder: Path, name: str, model: Path, service_port: int, steps: int) -> Path:
    """A small training run (the tiny model, frozen-lake and copy) whose env-host scores at the shared gateway."""
    extra = training_yaml(model, steps=steps) + f"  name: {name}\n  reward_service: {{port: {service_port}}}\n"
    path, _ = write_topology(
        folder / name, {"trainer": "trainer", "gen-0": "generator", "env-0": "env-host"}, extra_run=extra
    )
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_real_runs_share_one_reward_gateway_over_tcp(tmp_path: Path, tiny_model: Path) -> None:
    """`rollart run` three times: the service (one gateway), then two training runs that score there."""
    for name in ("service", "run-a", "run-b"):
        (tmp_path / name).mkdir()
    service_path, ports = write_topology(
        tmp_path / "service",
        {"reward": "reward-gateway"},
        extra_run="  name: reward-service\n  reward_pool: {max_workers: 2, jobs: "
        "[{name: run-a, secret_env: RUN_A_REWARD_SECRET}, {name: run-b, secret_env: RUN_B_REWARD_SECRET}]}\n",
    )
    port, admin = ports["reward"]
    secrets = {"RUN_A_REWARD_SECRET": "a-secret", "RUN_B_REWARD_SECRET": "b-secret"}
    service = launch(service_path, env=secrets)
    try:
        wait_for(lambda: healthy(admin), 60, "the shared gateway up")
        runs = {
            name: launch(
                real_run_topology(tmp_path, name, tiny_model, port, steps=3), env={"ROLLART_REWARD_SECRET": secret}
            )
            for name, secret in (("run-a", "a-secret"), ("run-b", "b-secret"))
        }
        for name, proc in runs.items():
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, (name, out[-3000:])
            steps = [line["step"] for line in read_jsonl(RunDir(tmp_path / name / "run").metrics) if "step" in line]
            assert steps == [1, 2, 3], (name, steps)
        jobs = http("GET", admin, "/status")[1]["reward_pool"]["jobs"]
        assert jobs.keys() == {"run-a", "run-b"}
        for name in ("run-a", "run-b"):
            assert jobs[name]["served"] >= 3 * 2 * 2 and jobs[name]["failed"] == 0, jobs  # steps x groups x G
        code, metrics = http("GET", admin, "/metrics")
        assert code == 200 and 'rollart_reward_job_served{job="run-a"}' in metrics
    finally:
        service.send_signal(signal.SIGINT)
        out, _ = service.communicate(timeout=60)
    assert service.returncode == 0, out[-3000:]
    assert "stopped cleanly" in out
