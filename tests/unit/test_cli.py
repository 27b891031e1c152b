"""The command line: which runs need the vLLM environment, and the error when it cannot be had."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from rollart.cli import IN_VENV_ENV, _own_venv, main
from rollart.rundir import RunDir
from rollart.topology import parse_topology

NODES = "nodes:\n  - {name: gen-0, role: generator, port: 17001, admin_port: 17002}\n"
ROLLOUT = "  rollout: {tasks: [{name: t, env: copy-reverse}]}\n"


def test_only_a_rollout_whose_generators_run_vllm_needs_the_vllm_environment() -> None:
    venv = _own_venv(parse_topology("run:\n" + ROLLOUT + NODES))  # vllm is the default backend
    assert venv is not None and (venv.module, venv.folder, venv.setup) == ("vllm", ".venv-vllm", "bin/setup-vllm")
    assert _own_venv(parse_topology("run:\n  generator: {backend: hf}\n" + ROLLOUT + NODES)) is None
    assert _own_venv(parse_topology(NODES)) is None  # no rollout: generators start no engine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this environment")
def test_run_says_how_to_get_vllm_when_even_its_environment_lacks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = tmp_path / "t.yaml"
    topology.write_text("run:\n" + ROLLOUT + NODES)
    monkeypatch.setenv(IN_VENV_ENV, "1")  # as after the re-run in .venv-vllm
    assert main(["run", str(topology)]) == 2
    assert "run bin/setup-vllm" in capsys.readouterr().err


def test_a_finished_run_is_moved_aside_and_an_unfinished_one_is_resumed(tmp_path: Path) -> None:
    from rollart.launch.local import Launcher, finished_step

    run_dir = tmp_path / "run"
    rollout = "{mode: train, tasks: [{name: t, env: copy-reverse}], steps: 80}"
    text = f"run:\n  run_dir: {run_dir}\n  rollout: {rollout}\n" + NODES
    topology = parse_topology(text)
    assert finished_step(topology) is None  # no checkpoint yet
    files = RunDir(run_dir)
    files.checkpoints.mkdir(parents=True)
    files.point_latest_at(files.checkpoint(50))
    assert finished_step(topology) is None  # a restart resumes from step 50
    files.point_latest_at(files.checkpoint(80))
    assert finished_step(topology) == 80
    assert finished_step(parse_topology(text.replace("steps: 80", "steps: 120"))) is None  # more steps asked for
    out = io.StringIO()
    more = text.replace("steps: 80", "steps: 120").replace("run:\n", "run:\n  model: {build_tiny_if_missing: false}\n")
    Launcher(parse_topology(more), "t.yaml", out=out)._prepare()
    assert f"{run_dir} holds a checkpoint at step 80: the trainer resumes from it" in out.getvalue()


def test_a_tiny_model_warmed_up_by_an_older_rollart_is_built_again(tmp_path: Path) -> None:
    import json

    from rollart.launch.local import Launcher
    from rollart.tiny.model import MARKER_FILE, build_tiny_model
    from rollart.tiny.warmup import WARMUP_POLICY, warmup_outdated

    model = tmp_path / "model"
    build_tiny_model(model, seed=0)
    assert warmup_outdated(model) is None  # built here, never warmed up: left alone
    marker = json.loads((model / MARKER_FILE).read_text())
    marker["format_warmup"] = {"steps": 100, "what": "format only"}  # as RollArt wrote it before
    (model / MARKER_FILE).write_text(json.dumps(marker))
    assert "not 'moves-that-move'" in (warmup_outdated(model) or "")
    rollout = "{mode: train, tasks: [{name: t, env: copy-reverse}], steps: 2}"
    text = f"run:\n  run_dir: {tmp_path / 'run'}\n  model: {{path: {model}, format_warmup_steps: 2}}\n"
    out = io.StringIO()
    Launcher(parse_topology(text + f"  rollout: {rollout}\n" + NODES), "t.yaml", out=out)._prepare()
    assert json.loads((model / MARKER_FILE).read_text())["format_warmup"]["policy"] == WARMUP_POLICY
    [aside] = tmp_path.glob("model.outdated-*")  # the old one is kept beside it
    assert json.loads((aside / MARKER_FILE).read_text())["format_warmup"]["what"] == "format only"
    assert "building it again" in out.getvalue()


def test_killing_a_node_kills_what_it_started(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    import time

    from rollart.launch.local import kill_group

    pid_file = tmp_path / "child.pid"
    script = (  # a "node" that starts a long-lived child, as a generator starts vLLM's engine core
        "import subprocess, sys, time, pathlib\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    node = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    kill_group(node.pid)
    assert node.wait(timeout=5) < 0
    for _ in range(100):  # the child is gone too (reaped by init, or a zombie no longer in the group)
        try:
            os.kill(child, 0)
            state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        except (ProcessLookupError, FileNotFoundError):
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"child {child} outlived its node")
