"""Tests of the topology file: the shipped local topology, defaults, secrets, and every error message."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import msgspec
import pytest
import yaml

from rollart.errors import ConfigError
from rollart.protocol.config import SessionConfig
from rollart.topology import NodeSpec, Resources, RestartPolicy, RunSpec, Topology, load_topology, parse_topology
from rollart.topology.roles import Role

LOCAL_YAML = pathlib.Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def _node(name: str, role: str, port: int, admin_port: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "role": role, "port": port, "admin_port": admin_port, **extra}


def _nodes(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    """A valid trainer and generator, then `extra` nodes."""
    return [_node("trainer", "trainer", 7100, 7200), _node("gen-0", "generator", 7101, 7201), *extra]


def _yaml(nodes: list[dict[str, Any]], **top: Any) -> str:
    return yaml.safe_dump({**top, "nodes": nodes}, sort_keys=False)


def _error(text: str, source: str = "t.yaml") -> str:
    with pytest.raises(ConfigError) as caught:
        parse_topology(text, source)
    return str(caught.value)


def test_local_yaml_loads() -> None:
    topology = load_topology(LOCAL_YAML)
    assert topology.run.name == "local"
    assert topology.run.secret_file is None
    assert topology.run.session == SessionConfig()
    assert topology.run_dir() == pathlib.Path("runs/local")
    assert [(n.name, n.role, n.hardware, n.port, n.admin_port) for n in topology.nodes] == [
        ("trainer", Role.TRAINER, "cpu", 7100, 7200),
        ("gen-compute", Role.GENERATOR, "compute", 7101, 7201),
        ("gen-bandwidth", Role.GENERATOR, "bandwidth", 7102, 7202),
        ("env-0", Role.ENV_HOST, "cpu", 7103, 7203),
        ("reward", Role.REWARD_GATEWAY, "cpu", 7104, 7204),
    ]
    assert [n.name for n in topology.nodes_with_role(Role.GENERATOR)] == ["gen-compute", "gen-bandwidth"]
    assert topology.restart_policy("env-0") == RestartPolicy(policy="on-failure")
    assert all(n.host == n.admin_host == "127.0.0.1" for n in topology.nodes)


def test_minimal_file_gets_every_default() -> None:
    topology = parse_topology(_yaml([_node("a", "trainer", 1, 2)]))
    assert topology.run == RunSpec()
    assert topology.nodes == [NodeSpec(name="a", role=Role.TRAINER, port=1, admin_port=2)]
    assert topology.nodes[0].resources == Resources(cpus=None, gpus=0, memory_gb=None)  # not given: the launcher picks
    assert topology.restart_policy(topology.nodes[0]) is topology.run.restart
    assert topology.run_dir() == pathlib.Path("runs/rollart")


def test_round_trip_of_defaults() -> None:
    topology = Topology(nodes=[NodeSpec(name="a", role=Role.TRAINER, port=1, admin_port=2)])
    data = msgspec.to_builtins(topology)
    del data["source"]  # set by the loader, not a key of the file
    assert parse_topology(yaml.safe_dump(data)) == topology


def test_node_override_of_restart_policy() -> None:
    own = {"policy": "stop-all", "max_restarts": 0}
    topology = parse_topology(_yaml(_nodes(_node("env-0", "env-host", 7102, 7202, restart=own))))
    assert topology.restart_policy("env-0") == RestartPolicy(policy="stop-all", max_restarts=0)
    assert topology.restart_policy("gen-0") == RestartPolicy()


def test_unknown_node_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        load_topology(LOCAL_YAML).node("gen-9")
    expected = "unknown node 'gen-9'; the topology has: trainer, gen-compute, gen-bandwidth, env-0, reward"
    assert str(caught.value) == expected


def test_missing_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        load_topology(path)
    assert str(caught.value) == f"{path}: cannot read: No such file or directory"


def test_secret_file_is_relative_to_the_topology_folder(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "secret.txt").write_bytes(b"s3cret\n")
    (folder / "token.txt").write_text("tok\n")
    run = {"secret_file": "secret.txt", "admin_token_file": "token.txt"}
    (folder / "t.yaml").write_text(_yaml(_nodes(), run=run))
    monkeypatch.setenv("ROLLART_SECRET", "from-env")
    monkeypatch.chdir(tmp_path)  # secret.txt is not in the working directory, only beside t.yaml
    topology = load_topology("conf/t.yaml")
    assert topology.read_secret() == b"s3cret"
    assert topology.read_admin_token() == "tok"


def test_secret_and_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    topology = parse_topology(_yaml(_nodes(), run={"secret_env": "MY_SECRET"}))
    monkeypatch.setenv("MY_SECRET", "abc")
    monkeypatch.setenv("ROLLART_ADMIN_TOKEN", "tok")
    assert topology.read_secret() == b"abc"
    assert topology.read_admin_token() == "tok"


def test_secret_missing_says_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLART_SECRET", raising=False)
    with pytest.raises(ConfigError) as caught:
        parse_topology(_yaml(_nodes()), "t.yaml").read_secret()
    assert str(caught.value) == (
        "t.yaml: run.secret_file: no secret: set the environment variable ROLLART_SECRET, "
        "or set run.secret_file to a file that holds it"
    )


def test_secret_file_empty_or_absent(tmp_path: pathlib.Path) -> None:
    (tmp_path / "empty").write_bytes(b"\n")
    path = tmp_path / "t.yaml"
    path.write_text(_yaml(_nodes(), run={"secret_file": "empty"}))
    with pytest.raises(ConfigError) as caught:
        load_topology(path).read_secret()
    assert str(caught.value) == (
        f"{path}: run.secret_file: {tmp_path / 'empty'} is empty; set the environment variable "
        "ROLLART_SECRET, or set run.secret_file to a file that holds it"
    )
    path.write_text(_yaml(_nodes(), run={"secret_file": "absent"}))
    with pytest.raises(ConfigError) as caught:
        load_topology(path).read_secret()
    expected = f"{path}: run.secret_file: cannot read {tmp_path / 'absent'}: No such file or directory"
    assert str(caught.value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            _yaml(_nodes(_node("g", "gen", 7102, 7202))),
            "nodes[2].role: expected one of trainer, generator, env-host, reward-gateway; got 'gen'",
            id="enum",
        ),
        pytest.param(
            _yaml(_nodes(_node("g", "generator", 7102, 7202, hardware="gpu"))),
            "nodes[2].hardware: expected one of cpu, compute, bandwidth; got 'gpu'",
            id="literal",
        ),
        pytest.param(
            _yaml(_nodes(_node("g", "generator", 7102, 7202, restart={"policy": "sometimes"}))),
            "nodes[2].restart.policy: expected one of on-failure, stop-all, never; got 'sometimes'",
            id="literal-inside-optional",
        ),
        pytest.param(
            _yaml([_node("a", "trainer", "7100", 7200)]),
            "nodes[0].port: expected int; got str",
            id="wrong-type",
        ),
        pytest.param(
            _yaml([_node("a", "trainer", 7100, 7200, resources="big")]),
            "nodes[0].resources: expected mapping; got str",
            id="wrong-type-struct",
        ),
        pytest.param(
            _yaml([{"name": "a", "role": "trainer", "prot": 1, "admin_port": 2}]),
            "nodes[0]: unknown key 'prot'; did you mean 'port'?",
            id="unknown-key-with-hint",
        ),
        pytest.param(
            _yaml(_nodes(_node("g", "generator", 7102, 7202, weather="rain"))),
            "nodes[2]: unknown key 'weather'",
            id="unknown-key-without-hint",
        ),
        pytest.param(
            "run:\n  generator: {max_batch_size: 8}\nnodes: []\n",
            "run.generator: unknown key 'max_batch_size'; it is called 'max_num_seqs' now",
            id="renamed-key",
        ),
        pytest.param(
            "run:\n  trainer: {weight_transport: tcp}\nnodes: []\n",
            "run.trainer: unknown key 'weight_transport'; it is called 'weights.transport' now "
            "(run.trainer.weights.transport)",
            id="moved-key",
        ),
        pytest.param(
            "nods: []\n",
            "unknown key 'nods'; did you mean 'nodes'?",
            id="unknown-top-level-key",
        ),
        pytest.param(
            _yaml(_nodes(), source="x.yaml"),
            "unknown key 'source' (the loader sets it to the file's path)",
            id="source-is-not-a-key",
        ),
        pytest.param(
            _yaml(_nodes({"role": "generator", "port": 7102, "admin_port": 7202})),
            "nodes[2]: missing required key 'name'",
            id="missing-key",
        ),
        pytest.param(
            _yaml(_nodes(_node("gen-1", "generator", 7102, 7202), _node("gen-0", "generator", 7103, 7203))),
            "nodes[3].name: duplicate node name 'gen-0' (also at nodes[1])",
            id="duplicate-name",
        ),
        pytest.param(
            _yaml(_nodes(_node("gen-1", "generator", 7102, 7101))),
            "nodes[2].admin_port: port 7101 on 127.0.0.1 is already used by nodes[1].port",
            id="port-clash",
        ),
        pytest.param(
            _yaml(_nodes(_node("gen-1", "generator", 7200, 7202, host="0.0.0.0")), run={"insecure": True}),
            "nodes[2].port: port 7200 on 0.0.0.0 is already used by nodes[0].admin_port",
            id="port-clash-with-wildcard",
        ),
        pytest.param(
            _yaml([_node("a", "trainer", 70000, 7200)]),
            "nodes[0].port: expected an integer from 1 to 65535; got 70000",
            id="port-range",
        ),
        pytest.param(
            _yaml([_node("Gen_0", "generator", 7100, 7200)]),
            "nodes[0].name: expected lowercase letters, digits and '-' (e.g. 'gen-0'); got 'Gen_0'",
            id="bad-name",
        ),
        pytest.param(
            _yaml(_nodes(), run={"session": {"heartbeat_deadline_s": 0.5}}),
            "run.session.heartbeat_deadline_s: expected more than heartbeat_interval_s (1.0); got 0.5",
            id="session-validate",
        ),
        pytest.param(
            _yaml(_nodes(), run={"restart": {"window_s": 0}}),
            "run.restart.window_s: expected a value > 0; got 0.0",
            id="restart-window",
        ),
        pytest.param(
            _yaml(_nodes(_node("g", "generator", 7102, 7202, restart={"max_restarts": -1}))),
            "nodes[2].restart.max_restarts: expected a value >= 0; got -1",
            id="node-restart-count",
        ),
        pytest.param(
            _yaml(_nodes(), run={"restart": {"backoff_base_s": 2.0, "backoff_cap_s": 1.0}}),
            "run.restart.backoff_cap_s: expected at least backoff_base_s (2.0); got 1.0",
            id="restart-backoff",
        ),
        pytest.param(
            _yaml(_nodes(), run={"drain_timeout_s": -1}),
            "run.drain_timeout_s: expected a value > 0; got -1.0",
            id="drain-timeout",
        ),
        pytest.param(
            _yaml(_nodes(), run={"run_dir": "runs/{run}"}),
            "run.run_dir: expected a path with no placeholder but {name}; got 'runs/{run}'",
            id="run-dir-placeholder",
        ),
        pytest.param(_yaml([]), "nodes: expected at least one node", id="no-nodes"),
        pytest.param("nodes:\n", "nodes: expected list; got null", id="nodes-null"),
        pytest.param(
            "nodes:\n  - name: a\n   role: trainer\n",
            "line 3, column 4: expected <block end>, but found '<block mapping start>'",
            id="yaml-syntax",
        ),
        pytest.param(
            "",
            "expected a mapping with 'nodes' (and optionally 'run'); the file is empty",
            id="empty-file",
        ),
        pytest.param(
            "- a\n- b\n",
            "expected a mapping with 'nodes' at the top level; got list",
            id="top-level-list",
        ),
    ],
)
def test_error_message(text: str, expected: str) -> None:
    assert _error(text) == f"t.yaml: {expected}"


def test_error_names_the_source_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(_yaml(_nodes(_node("g", "gen", 7102, 7202))))
    with pytest.raises(ConfigError) as caught:
        load_topology(path)
    expected = "nodes[2].role: expected one of trainer, generator, env-host, reward-gateway; got 'gen'"
    assert str(caught.value) == f"{path}: {expected}"


def test_semantic_problems_are_reported_together() -> None:
    text = _yaml(
        _nodes(_node("Bad", "generator", 7101, 0), _node("gen-0", "env-host", 7103, 7203)),
        run={"drain_timeout_s": 0},
    )
    assert _error(text).splitlines() == [
        "t.yaml: run.drain_timeout_s: expected a value > 0; got 0.0",
        "t.yaml: nodes[2].name: expected lowercase letters, digits and '-' (e.g. 'gen-0'); got 'Bad'",
        "t.yaml: nodes[2].port: port 7101 on 127.0.0.1 is already used by nodes[1].port",
        "t.yaml: nodes[2].admin_port: expected an integer from 1 to 65535; got 0",
        "t.yaml: nodes[3].name: duplicate node name 'gen-0' (also at nodes[1])",
    ]


def test_distinct_hosts_may_share_a_port() -> None:
    nodes = [_node("a", "trainer", 7100, 7200, host="10.0.0.1"), _node("b", "generator", 7100, 7201)]
    text = _yaml(nodes, run={"insecure": True})
    assert [n.port for n in parse_topology(text).nodes] == [7100, 7100]


def test_sim_mode_problems_name_their_paths() -> None:
    sim = {"speedup": 0, "model": "qwen3-70b", "engines": {"compute": {"gpu": "A100", "gpus": 0}}}
    text = _yaml(_nodes(), run={"generator": {"backend": "sim"}, "sim": sim})
    assert _error(text).splitlines() == [
        "t.yaml: run.sim.speedup: expected a value > 0; got 0.0",
        "t.yaml: run.sim.model: expected one of ['qwen2.5-7b', 'qwen3-14b', 'qwen3-30b-a3b', 'qwen3-32b', "
        "'qwen3-8b']; got 'qwen3-70b'",
        "t.yaml: run.sim.engines.compute.gpu: expected one of ['H100', 'H20', 'H200', 'H800']; got 'A100'",
        "t.yaml: run.sim.engines.compute.gpus: expected an integer >= 1; got 0",
        "t.yaml: nodes[1].hardware: run.sim.engines has no engine for 'cpu'",
    ]


def test_disaggregated_routing_needs_engines_that_hand_kv_on_of_both_classes() -> None:
    rollout = {"routing": "disaggregated", "tasks": [{"name": "lake", "env": "frozen-lake"}]}
    text = _yaml(_nodes(), run={"rollout": rollout, "sim": {"kv_link_gbps": 0}})
    assert _error(text).splitlines() == [
        "t.yaml: run.sim.kv_link_gbps: expected a value > 0; got 0.0",
        "t.yaml: run.generator.kv_store: disaggregated prefill on vllm needs generator.kv_store, the folder its "
        "engines hand KV cache through",
        "t.yaml: run.rollout.routing: disaggregated prefill needs compute and bandwidth generators; none has "
        "hardware ['bandwidth', 'compute']",
    ]
    text = _yaml(_nodes(), run={"rollout": rollout, "generator": {"backend": "hf", "kv_store": "/dev/shm/kv"}})
    assert _error(text).splitlines() == [
        "t.yaml: run.generator.kv_store: only the vllm backend hands KV cache on; backend is hf",
        "t.yaml: run.rollout.routing: disaggregated prefill hands KV cache between engines, which the vllm and sim "
        "backends do; got backend hf",
        "t.yaml: run.rollout.routing: disaggregated prefill needs compute and bandwidth generators; none has "
        "hardware ['bandwidth', 'compute']",
    ]
    both = [
        _node("c", "generator", 7102, 7202, hardware="compute"),
        _node("b", "generator", 7103, 7203, hardware="bandwidth"),
    ]
    text = _yaml(
        _nodes(*both),
        run={
            "rollout": rollout,
            "generator": {"backend": "sim"},
            "sim": {"engines": {"compute": {}, "bandwidth": {}, "cpu": {}}},
        },
    )
    assert parse_topology(text).run.rollout.routing == "disaggregated"  # type: ignore[union-attr]
    on_vllm = {"rollout": rollout, "generator": {"backend": "vllm", "kv_store": "/dev/shm/kv"}}
    assert parse_topology(_yaml(_nodes(*both), run=on_vllm)).run.generator.kv_store == "/dev/shm/kv"
    on_vllm["generator"]["tensor_parallel_size"] = 2
    assert _error(_yaml(_nodes(*both), run=on_vllm)).splitlines() == [
        "t.yaml: run.generator.kv_store: the KV store holds one rank's KV cache; expected tensor_parallel_size 1"
    ]


def test_a_listen_port_is_bound_and_checked_in_place_of_the_port_peers_dial() -> None:
    behind = _node("g", "generator", 7101, 7201, listen_port=7301)
    node = parse_topology(_yaml([_node("a", "trainer", 7100, 7200), behind])).nodes[1]
    assert (node.port, node.bind_port) == (7101, 7301)
    clash = _yaml([_node("a", "trainer", 7100, 7200), _node("g", "generator", 7101, 7201, listen_port=7200)])
    assert "nodes[1].listen_port: port 7200 on 127.0.0.1 is already used by nodes[0].admin_port" in _error(clash)


# -- env names, checked at load where that runs nobody's code --------------------------------


def _tasks(*tasks: dict[str, Any], **run: Any) -> str:
    return _yaml(_nodes(), run={"rollout": {"tasks": list(tasks)}, **run})


def test_an_unknown_builtin_env_is_refused_at_load_with_its_path_and_a_hint(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(_tasks({"name": "lake", "env": "frozen-lakes"}))
    with pytest.raises(ConfigError) as caught:
        load_topology(path)
    message = str(caught.value)
    expected = f"{path}: run.rollout.tasks[0].env: unknown env 'frozen-lakes'. Did you mean 'frozen-lake'?"
    assert message.startswith(expected + " Registered envs: ")
    assert "sokoban" in message and "(and gem:<id>, gym:<id>)" in message


def test_every_env_name_is_checked_the_wrapped_ones_too() -> None:
    text = _tasks(
        {"name": "a", "env": "frozen-lake"},
        {"name": "b", "env": "flaky", "env_kwargs": {"inner": "sokobam"}},
        {"name": "c", "env": "gym:"},
        {"name": "d", "env": "gems:math"},
    )
    lines = _error(text).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "run.rollout.tasks[1].env_kwargs.inner",
        "run.rollout.tasks[2].env",
        "run.rollout.tasks[3].env",
    ]
    assert "unknown env 'sokobam'. Did you mean 'sokoban'?" in lines[0]
    assert lines[1].endswith("env 'gym:': give an id after 'gym':, e.g. gym:<id>")
    assert "unknown env 'gems:math'." in lines[2]


def test_a_builtin_envs_keywords_and_a_tasks_reward_name_are_checked_at_load() -> None:
    text = _tasks(
        {"name": "a", "env": "frozen-lake", "env_kwargs": {"sise": 5}},
        {"name": "b", "env": "frozen-lake", "env_kwargs": {"size": 5}, "reward": "math-verify"},
        {"name": "c", "env": "agent", "agent": {"command": ["x"], "reward": "gateway"}, "reward": "exact_answer"},
        {"name": "d", "env": "agent", "agent": {"command": ["x"]}, "reward": "its own report: not checked"},
    )
    lines = _error(text).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "run.rollout.tasks[0].env_kwargs",
        "run.rollout.tasks[1].reward",
        "run.rollout.tasks[2].reward",
    ]
    assert "env 'frozen-lake': got an unexpected keyword argument 'sise'; it accepts: size" in lines[0]
    assert "unknown reward function 'math-verify'" in lines[1] and "did you mean 'math_verify'?" in lines[1]
    assert "did you mean 'exact-answer'?" in lines[2]
    # A user's reward modules may register any name in the gateway: left to it.
    user = parse_topology(_tasks({"name": "a", "env": "frozen-lake", "reward": "mine"}, reward_modules=["my_rewards"]))
    assert user.run.rollout is not None and user.run.rollout.tasks[0].reward == "mine"


def test_names_known_only_to_user_modules_or_families_are_left_to_the_env_host() -> None:
    # A family's id would need GEM or Gymnasium imported; a user module's names need its code run.
    families = parse_topology(_tasks({"name": "a", "env": "gym:NoSuchEnv-v0"}, {"name": "b", "env": "gem:x"}))
    assert families.run.rollout is not None
    assert [t.env for t in families.run.rollout.tasks] == ["gym:NoSuchEnv-v0", "gem:x"]
    user = parse_topology(_tasks({"name": "a", "env": "maze"}, env_modules=["my_pkg.my_envs"]))
    assert user.run.rollout is not None and user.run.rollout.tasks[0].env == "maze"


def test_loading_a_topology_imports_no_torch_and_no_env_module() -> None:
    script = (
        "import sys\n"
        "from rollart.errors import ConfigError\n"
        "from rollart.topology import load_topology, parse_topology\n"
        "load_topology('configs/local.yaml')\n"
        "bad = 'nodes: [{name: t, role: trainer, port: 7100, admin_port: 7200}]\\n'\n"
        "bad += 'run: {env_modules: [no_such_user_module], rollout: {tasks: [{name: a, env: maze}]}}'\n"
        "parse_topology(bad)\n"
        "try:\n"
        "    parse_topology(bad.replace('env_modules: [no_such_user_module], ', '').replace('maze', 'frozen-lakes'))\n"
        "except ConfigError as exc:\n"
        "    assert 'Did you mean' in str(exc), exc\n"
        "named = ('torch', 'transformers', 'gymnasium', 'gem', 'no_such_user_module')\n"
        "heavy = sorted(m for m in named if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "HEAVY []", out.stderr
