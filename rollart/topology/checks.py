"""What a topology's types cannot see: every problem with a decoded topology, as (YAML path, problem), all of
them at once (`parse_topology` raises one `ConfigError` naming each).

Each part's spec checks its own values (`validate()`); a training or generation backend's registry checks what a
spec asks of the backend; the checks here span parts: names and ports of nodes, env and reward names, restart
policies, the reward pool and a shared reward service, generators against the run's routing, and (in their own
modules) exposure, trainer groups and GPUs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import msgspec

from rollart.envs.registry import env_kwargs_problem, unknown_env
from rollart.errors import ConfigError
from rollart.generation.registry import GENERATION_BACKENDS
from rollart.generation.registry import backend as generation_backend
from rollart.generation.registry import check as generation_check
from rollart.models.presets import preset, unknown_preset
from rollart.topology import exposure, gpus, trainers
from rollart.topology.roles import Role
from rollart.training.registry import check as training_check

if TYPE_CHECKING:
    from rollart.rewards.config import RewardPoolSpec
    from rollart.rollout.config import TaskSpec
    from rollart.topology import RestartPolicy, Topology

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_WILDCARD_HOSTS = {"0.0.0.0", "::"}


def _check_generators(topology: Topology) -> list[tuple[str, str]]:
    """Simulated generators need an engine shape for their hardware. `rollout.routing: disaggregated` hands KV
    cache between engines: a backend that can (`GenerationBackend.kv_handoff`), through a KV store where it uses
    one (`generator.kv_store`), with a generator to prefill on (hardware compute) and one to decode on
    (bandwidth)."""
    run, problems = topology.run, []
    record = generation_backend(run.generator.backend)
    if record.simulated:
        for i, node in enumerate(topology.nodes):
            if node.role is Role.GENERATOR and node.hardware not in run.sim.engines:
                problems.append((f"nodes[{i}].hardware", f"run.sim.engines has no engine for {node.hardware!r}"))
    if run.rollout is None or run.rollout.routing != "disaggregated":
        return problems
    if not record.kv_handoff:
        takes = " and ".join(name for name, other in GENERATION_BACKENDS.items() if other.kv_handoff)
        problem = (
            f"disaggregated prefill hands KV cache between engines, which the {takes} backends do; "
            f"got backend {run.generator.backend}"
        )
        problems.append(("run.rollout.routing", problem))
    elif record.kv_store and run.generator.kv_store is None:
        problem = (
            f"disaggregated prefill on {run.generator.backend} needs generator.kv_store, the folder its engines hand "
            "KV cache through"
        )
        problems.append(("run.generator.kv_store", problem))
    kinds = {node.hardware for node in topology.nodes if node.role is Role.GENERATOR}
    if missing := sorted({"compute", "bandwidth"} - kinds):
        problem = f"disaggregated prefill needs compute and bandwidth generators; none has hardware {missing}"
        problems.append(("run.rollout.routing", problem))
    return problems


def check(topology: Topology) -> list[tuple[str, str]]:
    """Problems msgspec's types cannot see, as (YAML path, problem), all of them."""
    run = topology.run
    problems = [(f"run.session.{field}", problem) for field, problem in run.session.validate()]
    try:
        run.run_dir.format(name=run.name)
    except (KeyError, IndexError, ValueError):
        problem = f"expected a path with no placeholder but {{name}}; got {run.run_dir!r}"
        problems.append(("run.run_dir", problem))
    problems += _below_zero("run", run, positive=("drain_timeout_s",))
    problems += _check_restart("run.restart", run.restart)
    if run.rollout is not None:
        problems += [(f"run.rollout.{field}", problem) for field, problem in run.rollout.validate()]
        problems += _check_env_names(run.rollout.tasks, run.env_modules)
        problems += _check_reward_names(run.rollout.tasks, run.reward_modules)
    problems += [(f"run.trainer.{field}", problem) for field, problem in run.trainer.validate()]
    problems += [(f"run.trainer.{field}", problem) for field, problem in training_check(run.trainer)]
    problems += [(f"run.sim.{field}", problem) for field, problem in run.sim.validate()]
    problems += [(f"run.generator.{field}", problem) for field, problem in run.generator.validate()]
    problems += [(f"run.generator.{field}", problem) for field, problem in generation_check(run.generator)]
    problems += [(f"run.tracking.{field}", problem) for field, problem in run.tracking.validate()]
    if run.model.shape is not None and preset(run.model.shape) is None:
        problems.append(("run.model.shape", unknown_preset(run.model.shape)))
    problems += _check_generators(topology)
    problems += _check_reward_pool(run.reward_pool, run.name)
    problems += _check_reward_service(topology)
    if not topology.nodes:
        problems.append(("nodes", "expected at least one node"))
    first_with_name: dict[str, int] = {}
    listening: list[tuple[str, int, str]] = []  # (host, port, YAML path) of every socket so far
    for i, node in enumerate(topology.nodes):
        at = f"nodes[{i}]"
        if not _NAME.match(node.name):
            problem = f"expected lowercase letters, digits and '-' (e.g. 'gen-0'); got {node.name!r}"
            problems.append((f"{at}.name", problem))
        if (first := first_with_name.setdefault(node.name, i)) != i:
            problems.append((f"{at}.name", f"duplicate node name {node.name!r} (also at nodes[{first}])"))
        sockets = [("listen_port" if node.listen_port else "port", node.host), ("admin_port", node.admin_host)]
        sockets += [("rendezvous_port", node.host)] if node.rendezvous_port is not None else []
        for key, host in sockets:
            port = getattr(node, key)
            if not 1 <= port <= 65535:
                problems.append((f"{at}.{key}", f"expected an integer from 1 to 65535; got {port}"))
                continue
            for other_host, other_port, other_at in listening:
                if port == other_port and (host == other_host or {host, other_host} & _WILDCARD_HOSTS):
                    problems.append((f"{at}.{key}", f"port {port} on {host} is already used by {other_at}"))
                    break
            listening.append((host, port, f"{at}.{key}"))
        problems += _below_zero(f"{at}.resources", node.resources, ("cpus", "memory_gb", "network_gbps"), ("gpus",))
        if node.restart is not None:
            problems += _check_restart(f"{at}.restart", node.restart)
    problems += exposure.check_exposure(topology)
    return problems + trainers.check_trainer_groups(topology) + gpus.check_gpus(topology)


def _check_reward_pool(pool: RewardPoolSpec, run_name: str) -> list[tuple[str, str]]:
    problems = _below_zero("run.reward_pool", pool, ("max_workers", "idle_timeout_s"), ("min_workers",))
    problems += [(f"run.reward_pool.limits.{field}", problem) for field, problem in pool.limits.validate()]
    problems += [(f"run.reward_pool.sandbox.{field}", problem) for field, problem in pool.sandbox.validate()]
    if pool.min_workers > pool.max_workers:
        problems.append(("run.reward_pool.min_workers", f"expected at most max_workers ({pool.max_workers})"))
    seen: set[str] = set()
    for i, job in enumerate(pool.jobs):
        at = f"run.reward_pool.jobs[{i}]"
        if not _NAME.match(job.name):
            problems.append((f"{at}.name", f"expected lowercase letters, digits and '-'; got {job.name!r}"))
        elif job.name == run_name or job.name in seen:
            what = "this run's own name" if job.name == run_name else "a name listed twice"
            problems.append((f"{at}.name", f"{job.name!r} is {what}: each job needs a name of its own"))
        seen.add(job.name)
        if (job.secret_env is None) == (job.secret_file is None):
            problems.append((at, "expected one of secret_env or secret_file: the secret that run's env-hosts prove"))
        if job.weight <= 0:
            problems.append((f"{at}.weight", f"expected a value > 0; got {job.weight}"))
    return problems


def _check_reward_service(topology: Topology) -> list[tuple[str, str]]:
    service = topology.run.reward_service
    if service is None:
        return []
    problems = []
    if not 1 <= service.port <= 65535:
        problems.append(("run.reward_service.port", f"expected an integer from 1 to 65535; got {service.port}"))
    job = service.job if service.job is not None else topology.run.name
    if not _NAME.match(job):
        where = "run.reward_service.job" if service.job is not None else "run.name"
        problems.append((where, f"the name at the reward service: lowercase letters, digits and '-'; got {job!r}"))
    for i, node in enumerate(topology.nodes):
        if node.role is Role.REWARD_GATEWAY:
            problem = "this run uses the shared gateway of run.reward_service: drop this node, or that setting"
            problems.append((f"nodes[{i}].role", problem))
    return problems


def _check_env_names(tasks: list[TaskSpec], env_modules: list[str]) -> list[tuple[str, str]]:
    """Each task's env, and the `inner` env a wrapper (`flaky`) names, against the registry: a typo
    is refused here, not in an env-host's log. Only what is known without running anyone's code:
    RollArt's built-ins and the `gem:`/`gym:` prefixes (standard library only). With
    `run.env_modules` nothing is checked (a user module may register any name, and it is imported
    only in env workers); nor is a family's id (importing GEM or Gymnasium is the env-host's job)."""
    if env_modules:
        return []
    named = [
        (f"run.rollout.tasks[{i}].{key}", name)
        for i, task in enumerate(tasks)
        for key, name in (("env", task.env), ("env_kwargs.inner", task.env_kwargs.get("inner")))
        if isinstance(name, str) and task.agent is None
    ]
    problems = [(at, problem) for at, name in named if (problem := unknown_env(name)) is not None]
    problems += [
        (f"run.rollout.tasks[{i}].env_kwargs", problem)
        for i, task in enumerate(tasks)
        if task.agent is None and (problem := env_kwargs_problem(task.env, task.env_kwargs)) is not None
    ]
    return problems


def _check_reward_names(tasks: list[TaskSpec], reward_modules: list[str]) -> list[tuple[str, str]]:
    """Each task's reward function the gateway runs, against RollArt's built-ins (with `run.reward_modules`,
    which may register any name in the gateway, nothing is checked): a typo is refused here, not by every
    trajectory's scoring."""
    if reward_modules:
        return []
    from rollart.rewards import get_reward

    problems = []
    for i, task in enumerate(tasks):
        if task.agent is not None and task.agent.reward == "report":
            continue  # the program reports its own
        try:
            get_reward(task.reward)
        except ConfigError as exc:
            problems.append((f"run.rollout.tasks[{i}].reward", str(exc)))
    return problems


def _check_restart(at: str, policy: RestartPolicy) -> list[tuple[str, str]]:
    positive = ("window_s", "backoff_base_s", "backoff_cap_s")
    problems = _below_zero(at, policy, positive, non_negative=("max_restarts",))
    if policy.backoff_cap_s < policy.backoff_base_s:
        problem = f"expected at least backoff_base_s ({policy.backoff_base_s}); got {policy.backoff_cap_s}"
        problems.append((f"{at}.backoff_cap_s", problem))
    return problems


def _below_zero(
    at: str, spec: msgspec.Struct, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """(path, problem) for each `positive` field <= 0 and each `non_negative` field < 0; None passes."""
    problems = []
    for key in positive + non_negative:
        value, strict = getattr(spec, key), key in positive
        if value is not None and (value <= 0 if strict else value < 0):
            problems.append((f"{at}.{key}", f"expected a value {'>' if strict else '>='} 0; got {value!r}"))
    return problems
