"""The typed topology file: which nodes a run has, where they listen, and how they restart.

A topology is YAML (see `configs/local.yaml` and `docs/topology.md`) decoded into the frozen
msgspec structs below by `load_topology(path)` or `parse_topology(text)`. Every problem,
from a YAML syntax error to two nodes on one port, raises one `ConfigError` whose lines read
`{source}: {yaml path}: {problem}` (msgspec's own messages put in those terms by `explain.py`).
A trainer that spans hosts is a group of trainer nodes; its rules are in `trainers.py`. The package
imports no torch, and of `rollart` only the specs' parts and the errors, so the launcher and CLI
start fast.
"""

from __future__ import annotations

import os
import pathlib
from typing import Literal, TypeAlias

import msgspec
import yaml

from rollart.errors import ConfigError
from rollart.generation.config import GeneratorSpec
from rollart.protocol.config import SessionConfig
from rollart.protocol.tls import NodeTls, TlsSpec
from rollart.rewards.config import RewardPoolSpec, RewardServiceSpec
from rollart.rollout.config import ModelSpec, RolloutSpec
from rollart.sim.config import SimSpec
from rollart.topology import checks, exposure, trainers
from rollart.topology.explain import explain
from rollart.topology.roles import REWARD_SERVICE, Role
from rollart.tracking.config import TrackingSpec
from rollart.training.spec import RankLayout, TrainerSpec

Hardware: TypeAlias = Literal["cpu", "compute", "bandwidth"]
"""cpu; compute: prefill-friendly GPUs (like H800); bandwidth: decode-friendly GPUs (like H20)."""


class RestartPolicy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What the launcher does when a node's process dies."""

    policy: Literal["on-failure", "stop-all", "never"] = "on-failure"
    """on-failure: restart with backoff; stop-all: stop the run naming the node; never: leave it dead."""
    max_restarts: int = 5
    """Restarts allowed within `window_s`; one more stops the run."""
    window_s: float = 300.0
    """Sliding window over which restarts are counted."""
    backoff_base_s: float = 0.5
    """Delay before the first restart; it doubles with each restart in the window."""
    backoff_cap_s: float = 10.0
    """Largest delay between restarts."""


class Resources(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What a node needs from its machine."""

    cpus: float | None = None
    """CPU cores for the node (0.5: half of one); None: not given. The local launcher pins the node
    to that many (`rollart.launch.placement`; when no node gives any, it picks a split), Slurm
    reserves them rounded up (1 when not given)."""
    gpus: int = 0
    """GPUs given to the node."""
    gpu_type: str | None = None
    """The kind of those GPUs (H100, H800, H200, H20, A100-80G, L40S, ...: `rollart.topology.gpus`), whose
    memory `rollart check` sizes the node against; None: not sized."""
    gpu_memory_gb: float | None = None
    """Memory of each of those GPUs in GiB, for a kind not in the table; overrides the table's."""
    gpu_ids: list[int] | None = None
    """Which of its host's GPUs the node gets (indices into what the launcher sees); None: the next free
    ones, in topology order. Slurm picks its own."""
    share_gpus: bool = False
    """Whether another node may be given the same GPUs; two nodes share one only when both say so."""
    memory_gb: float | None = None
    """Memory limit in GiB; None: no limit."""
    network_gbps: float | None = None
    """The bandwidth of the node's link to other hosts in Gb/s, which `rollart check` estimates weight pushes
    with; None: not given (10 Gb/s assumed, and said)."""


class NodeSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One daemon of the run."""

    name: str
    """Unique name: lowercase letters, digits and '-', at most 63 characters."""
    role: Role
    """What the node does: trainer, generator, env-host or reward-gateway."""
    host: str = "127.0.0.1"
    """Where its session port listens and where peers connect to it."""
    port: int
    """Session port (1-65535), where peers connect to it."""
    listen_port: int | None = None
    """The port its session listener binds when peers reach it through a forwarder (a NAT rule, a
    port forward, a proxy) at `port`; None: `port` itself."""
    admin_host: str = "127.0.0.1"
    """Where the admin HTTP endpoint binds; loopback unless the topology says otherwise."""
    admin_port: int
    """Admin HTTP port (1-65535)."""
    cluster: str = ""
    """Which cluster (site, network) the node is in: weight relay chains stay within one where they
    can (generators ordered by cluster, then host)."""
    hardware: Hardware = "cpu"
    """Kind of machine: cpu, compute (prefill-friendly) or bandwidth (decode-friendly)."""
    resources: Resources = Resources()
    """What the node needs from its machine."""
    restart: RestartPolicy | None = None
    """This node's restart policy; None: use run.restart."""
    primary: str | None = None
    """On a trainer node: the primary trainer whose group it joins, running `run.trainer.ranks` more
    of its ranks and nothing else (a member); None: the run's trainer, the primary of its group."""
    rendezvous_port: int | None = None
    """On the primary trainer: the port (on `host`) where it serves its ranks' rendezvous store,
    needed when it has members; None: a free port, found only by ranks on its own host."""

    @property
    def bind_port(self) -> int:
        """The port its session listener binds."""
        return self.port if self.listen_port is None else self.listen_port


class RunSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Settings of the whole run."""

    name: str = "rollart"
    """Name of the run; fills the `{name}` placeholder of run_dir."""
    run_dir: str = "runs/{name}"
    """Folder for logs and checkpoints; relative paths are relative to the working directory."""
    secret_file: str | None = None
    """File holding the session secret, relative to the topology's folder; None: use secret_env."""
    secret_env: str = "ROLLART_SECRET"
    """Environment variable holding the session secret when secret_file is not set."""
    admin_token_file: str | None = None
    """File holding the admin HTTP token, relative to the topology's folder; None: use admin_token_env."""
    admin_token_env: str = "ROLLART_ADMIN_TOKEN"
    """Environment variable holding the admin token when admin_token_file is not set."""
    session: SessionConfig = SessionConfig()
    """Framing limits and session timing shared by every node."""
    tls: TlsSpec | None = None
    """TLS 1.3 with mutual certificates on every session and bulk connection (and HTTPS on the admin
    endpoints); None: none, which a node listening beyond loopback refuses unless `insecure` says so."""
    insecure: bool = False
    """Let nodes listen beyond loopback without TLS: sessions, weights and admin tokens then cross the
    network in the clear (a network you trust end to end, nothing else; docs/security.md)."""
    restart: RestartPolicy = RestartPolicy()
    """Restart policy of every node that does not set its own."""
    drain_timeout_s: float = 30.0
    """How long a stopping node may finish in-flight work before it is killed."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level written."""
    model: ModelSpec = ModelSpec()
    """The policy model."""
    rollout: RolloutSpec | None = None
    """Tasks, groups and staleness; None: the nodes only start and answer status."""
    generator: GeneratorSpec = GeneratorSpec()
    """The inference engine of every generator."""
    reward_pool: RewardPoolSpec = RewardPoolSpec()
    """The reward gateway's worker pool."""
    reward_service: RewardServiceSpec | None = None
    """A reward gateway shared by several runs (another topology's) that this run's env-hosts use;
    the run then has no reward-gateway node. None: the run's own reward-gateway node."""
    trainer: TrainerSpec = TrainerSpec()
    """How the trainer trains and pushes weights (rollout mode `train`)."""
    env_modules: list[str] = []
    """Python modules imported by env-hosts before they start, to register your own environments."""
    reward_modules: list[str] = []
    """Python modules imported by the reward gateway before it starts, to register your own reward
    functions (`rollart.rewards.register_reward`)."""
    sim: SimSpec = SimSpec()
    """Simulation mode: the simulated model and engines (`generator.backend: sim`) and the clock."""
    tracking: TrackingSpec = TrackingSpec()
    """Where the trainer's metrics go besides metrics.jsonl: TensorBoard (by default), W&B, MLflow."""


class Topology(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A whole run: its settings and its nodes."""

    run: RunSpec = RunSpec()
    """Settings of the whole run."""
    nodes: list[NodeSpec]
    """The run's daemons; at least one."""
    source: str = "<string>"
    """Set by the loader to the file's path (not a key of the file); names it in errors."""

    def node(self, name: str) -> NodeSpec:
        """Return the node called `name`."""
        for spec in self.nodes:
            if spec.name == name:
                return spec
        names = ", ".join(spec.name for spec in self.nodes)
        raise ConfigError(f"unknown node {name!r}; the topology has: {names}")

    def nodes_with_role(self, role: Role) -> list[NodeSpec]:
        """Return the nodes of `role`, in file order."""
        return [spec for spec in self.nodes if spec.role is role]

    def trainer_group(self, name: str) -> list[NodeSpec]:
        """Trainer node `name`'s group: its primary, then the members in file order."""
        return trainers.trainer_group(self, name)

    def rank_layout(self, name: str) -> RankLayout:
        """Where trainer node `name`'s ranks sit in its group (`rollart.topology.trainers`)."""
        return trainers.rank_layout(self, name)

    def restart_policy(self, node: NodeSpec | str) -> RestartPolicy:
        """Return the node's own restart policy, or run.restart when it has none."""
        spec = self.node(node) if isinstance(node, str) else node
        return spec.restart if spec.restart is not None else self.run.restart

    def run_dir(self) -> pathlib.Path:
        """Return run.run_dir with `{name}` filled in."""
        return pathlib.Path(self.run.run_dir.format(name=self.run.name))

    def node_tls(self, name: str) -> NodeTls | None:
        """Node `name`'s TLS (its files read and checked now), or None without `run.tls`."""
        return exposure.node_tls(self, name)

    def read_secret(self) -> bytes:
        """Return the session secret, from run.secret_file if set, else from $run.secret_env."""
        return self._read_credential("secret", "secret_file", self.run.secret_file, self.run.secret_env)

    def read_reward_service_secret(self) -> bytes:
        """The secret the shared reward gateway of `run.reward_service` knows this run by."""
        service = self.run.reward_service
        if service is None:
            raise ConfigError(f"{self.source}: run.reward_service is not set")
        where = "reward_service.secret_file"
        return self._read_credential("reward service secret", where, service.secret_file, service.secret_env)

    def other_sessions(self, spec: NodeSpec) -> list[str]:
        """Node `spec`'s sessions with other runs, by the names their secrets go under: an env-host's with
        the shared reward gateway of `run.reward_service` (`REWARD_SERVICE`), a reward gateway's with each
        run of `run.reward_pool.jobs` (the job's name); none for the rest."""
        if spec.role is Role.ENV_HOST and self.run.reward_service is not None:
            return [REWARD_SERVICE]
        if spec.role is Role.REWARD_GATEWAY:
            return [job.name for job in self.run.reward_pool.jobs]
        return []

    def other_secrets(self, spec: NodeSpec) -> dict[str, bytes]:
        """The secrets of node `spec`'s `other_sessions`, read now."""
        if spec.role is Role.REWARD_GATEWAY:
            return self.read_reward_job_secrets()
        return {name: self.read_reward_service_secret() for name in self.other_sessions(spec)}

    def credential_variables(self) -> list[str]:
        """Every environment variable a node reads a credential from (a node drops them all once read,
        so no process it starts inherits one)."""
        run = self.run
        names = [run.secret_env, run.admin_token_env]
        names += [job.secret_env for job in run.reward_pool.jobs if job.secret_env]
        names += [run.reward_service.secret_env] if run.reward_service is not None else []
        return names

    def read_reward_job_secrets(self) -> dict[str, bytes]:
        """The secrets of the other runs this run's reward gateway serves (`run.reward_pool.jobs`), by job."""
        jobs = self.run.reward_pool.jobs
        return {
            job.name: self._read_credential(
                f"secret of reward job {job.name!r}",
                f"reward_pool.jobs[{i}].secret_file",
                job.secret_file,
                job.secret_env or "",
            )
            for i, job in enumerate(jobs)
        }

    def read_admin_token(self) -> str:
        """Return the admin token, from run.admin_token_file if set, else from $run.admin_token_env."""
        token = self._read_credential(
            "admin token", "admin_token_file", self.run.admin_token_file, self.run.admin_token_env
        )
        return token.decode()

    def _read_credential(self, what: str, key: str, file: str | None, env: str) -> bytes:
        both_ways = f"set the environment variable {env}, or set run.{key} to a file that holds it"
        if file is None:
            value = os.environ.get(env, "").strip().encode()
            if not value:
                raise ConfigError(f"{self.source}: run.{key}: no {what}: {both_ways}")
            return value
        path = pathlib.Path(self.source).parent / file
        try:
            value = path.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"{self.source}: run.{key}: cannot read {path}: {exc.strerror}") from exc
        if not value:
            raise ConfigError(f"{self.source}: run.{key}: {path} is empty; {both_ways}")
        return value


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read and check the topology file at `path`; errors name it as given."""
    source = os.fspath(path)
    try:
        text = pathlib.Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from exc
    return parse_topology(text, source)


def parse_topology(text: str | bytes, source: str = "<string>") -> Topology:
    """Decode and check topology YAML; `source` names it in errors and anchors relative files."""
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{source}: {where}{exc.problem}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    if data is None:
        raise ConfigError(f"{source}: expected a mapping with 'nodes' (and optionally 'run'); the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with 'nodes' at the top level; got {type(data).__name__}")
    if "source" in data:
        raise ConfigError(f"{source}: unknown key 'source' (the loader sets it to the file's path)")
    try:
        topology = msgspec.convert({**data, "source": source}, Topology)
    except msgspec.ValidationError as exc:
        path, problem = explain(str(exc), data, Topology)
        raise ConfigError(f"{source}: {path + ': ' if path else ''}{problem}") from exc
    problems = checks.check(topology)
    if problems:
        raise ConfigError("\n".join(f"{source}: {path}: {problem}" for path, problem in problems))
    rollout = topology.run.rollout
    if rollout is not None and rollout.schedule == "sync":
        # The synchronous baseline is the same config with no overlap: whole batches, no staleness.
        rollout = msgspec.structs.replace(rollout, alpha=0, env_stepping="batch")
        topology = msgspec.structs.replace(topology, run=msgspec.structs.replace(topology.run, rollout=rollout))
    return topology
