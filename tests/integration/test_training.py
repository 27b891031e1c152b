"""Training with real node processes on loopback: async and sync schedules, weight pushes, resume.

Each test starts the nodes of a small topology itself (trainer, two generators of different
hardware classes, an env-host, a reward gateway) with `mode: train`, watches them through their
admin `/status`, and reads what the trainer wrote to the run folder: `metrics.jsonl` (a baseline
line, then one line per step), `timeline.jsonl` (one line per trained trajectory) and the
checkpoints. One test drives a generator node alone, pushing weights to it from the test while
it generates, to see a long request finish partly under each version.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from rollart.rundir import RunDir
from tests.integration.cluster import GENERATORS, NODES, SECRET, Cluster, make_cluster, training_yaml
from tests.support import node_client, wait_for

pytestmark = pytest.mark.integration


def trainer_done(cluster: Cluster, timeout: float) -> dict[str, Any]:
    return cluster.wait_status("trainer", lambda s: s["done"], timeout, "the trainer to finish its steps")


def receiver_version(status: dict[str, Any]) -> int:
    """The version a generator's WeightReceiver last applied (handed to the engine)."""
    return int(status["engine"]["weights"]["version"])


def settle_generators(cluster: Cluster, version: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Each generator's /status `engine` once all of them run `version` (received and in the model),
    or as they are after `timeout` seconds (the caller checks what it tolerates)."""
    deadline = time.monotonic() + timeout
    while True:
        engines = {name: cluster.status(name)["engine"] for name in GENERATORS}
        at = [e["version"] == e["weights"]["version"] == version for e in engines.values()]
        if all(at) or time.monotonic() > deadline:
            return engines
        time.sleep(0.1)


def step_lines(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in metrics if "step" in line]


def check_step_lines(lines: list[dict[str, Any]], steps: range) -> None:
    """One line per step, in order, each at the version the step made, with finite numbers; a step
    trains on tokens unless none of its groups had signal (then it takes no optimizer step)."""
    assert [line["step"] for line in lines] == list(steps)
    for line in lines:
        assert line["version"] == line["step"]
        for key in ("loss", "grad_norm", "reward_mean", "staleness_max"):
            assert math.isfinite(line[key]), (key, line)
        assert (line["tokens"] > 0) == (line["groups_trained"] > 0), line


def check_tensorboard(run_dir: Path, lines: list[dict[str, Any]]) -> None:
    """The step lines are in the run's TensorBoard events too (`run.tracking`'s default), read back with
    TensorBoard's own reader (the tracker writes from a thread of its own: waited for)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def reward_means() -> list[tuple[int, float]] | None:
        events = EventAccumulator(str(RunDir(run_dir).tensorboard))
        events.Reload()
        if "reward_mean" not in events.Tags()["scalars"]:
            return None
        seen = [(e.step, e.value) for e in events.Scalars("reward_mean")]
        return seen if len(seen) >= len(lines) else None

    seen = wait_for(reward_means, timeout=15, what="the step lines in TensorBoard's events")
    assert [step for step, _ in seen] == [line["step"] for line in lines]
    assert [value for _, value in seen] == pytest.approx([line["reward_mean"] for line in lines], abs=1e-6)


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
# nccl: weights broadcast over a group of the trainer and both generators (gloo here), formed once
@pytest.mark.parametrize("transport", ["tcp", "nccl"], ids=["tcp", "nccl_transport"])
def test_async_training_runs_its_steps_and_pushes_every_version(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster], transport: str
) -> None:
    steps = 3
    yaml = training_yaml(tiny_model, steps=steps, alpha=1, transport=transport)
    cluster = make_cluster(clusters, tmp_path, yaml)
    started = time.monotonic()
    cluster.start()
    cluster.wait_healthy()
    done = trainer_done(cluster, timeout=180)
    took = time.monotonic() - started
    assert done["rollout"]["version"] == done["rollout"]["batches"] == steps

    metrics = cluster.metrics()
    baseline = [line for line in metrics if line.get("baseline")]
    assert len(baseline) == 1 and metrics[0] is baseline[0]
    assert done["training"]["baseline"] == baseline[0]["tasks"]
    lines = step_lines(metrics)
    check_step_lines(lines, range(1, steps + 1))
    check_tensorboard(cluster.run_dir, lines)
    for line in lines:
        assert line["stall_s"] < 1.0, line  # the trainer waits for a snapshot copy, never for a push
        # tokens come from weights at most alpha behind the trajectory's start, itself at most alpha behind
        assert 0 <= line["staleness_max"] <= 2, line
    assert done["training"]["stall_s_max"] < 1.0

    # The pushes are asynchronous: the last one may still be landing when the trainer says done.
    final = settle_generators(cluster, steps, timeout=10)
    for name, engine in final.items():
        assert steps - 1 <= engine["weights"]["version"] <= steps, (name, engine)
        assert engine["version"] == engine["weights"]["version"], engine  # the model has what was received
        pushed = done["training"]["weights"][name]
        assert pushed["failures"] == 0 and pushed["pushes"] >= 1 and pushed["transport"] == transport, pushed
        if transport == "nccl":
            joined = cluster.events(name, "weights.group_joined")
            assert joined and all(event["backend"] == "gloo" for event in joined), joined
    if transport == "nccl":
        assert len(cluster.events("trainer", "weights.group_formed")) == 1  # the same two generators throughout

    timeline = cluster.timeline()
    trained = steps * 2 * 2  # steps x batch_groups x group_size
    assert len(timeline) == trained
    assert len({t["trajectory_id"] for t in timeline}) == trained
    assert sorted(t["step"] for t in timeline) == sorted(list(range(1, steps + 1)) * 4)
    for t in timeline:
        assert t["spans"], t
        assert t["started_at"] <= t["finished_at"]
        for _kind, a, b in t["spans"]:
            assert t["started_at"] - 0.01 <= a <= b <= t["finished_at"] + 0.01, t
    assert cluster.stop() == dict.fromkeys(NODES, 0)  # every node drains and exits cleanly
    print(f"async training: {steps} steps in {took:.1f} s; generators at", {n: e["version"] for n, e in final.items()})


@pytest.mark.timeout(240)
def test_sync_baseline_trains_on_fresh_tokens_and_waits_for_every_push(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    steps = 3
    cluster = make_cluster(clusters, tmp_path, training_yaml(tiny_model, steps=steps, schedule="sync"))
    started = time.monotonic()
    cluster.start()
    cluster.wait_healthy()
    done = trainer_done(cluster, timeout=180)
    took = time.monotonic() - started
    assert done["rollout"]["version"] == done["rollout"]["batches"] == steps
    assert done["rollout"]["alpha"] == 0  # the loader's sync baseline

    lines = step_lines(cluster.metrics())
    check_step_lines(lines, range(1, steps + 1))
    for line in lines:
        # Every loss token was generated by the weights the step started from (version step - 1).
        assert line["staleness_max"] == 0 and line["staleness_mean"] == 0, line

    # The trainer waited for every push before going on, the last one included.
    for name in GENERATORS:
        pushed = done["training"]["weights"][name]
        assert pushed["version"] == steps and pushed["skipped"] == 0 and pushed["failures"] == 0, pushed
        assert receiver_version(cluster.status(name)) == steps
    # ... which its log shows in order: every generator took version n before step n was recorded.
    trainer_log = cluster.events("trainer", "weights.pushed", "trainer.step")
    for step in range(1, steps + 1):
        at = next(i for i, r in enumerate(trainer_log) if r["event"] == "trainer.step" and r["step"] == step)
        before = {r["target"] for r in trainer_log[:at] if r["event"] == "weights.pushed" and r["version"] == step}
        assert before == set(GENERATORS), (step, trainer_log)
    final = settle_generators(cluster, steps, timeout=10)
    assert all(engine["version"] == steps for engine in final.values()), final
    assert cluster.stop() == dict.fromkeys(NODES, 0)
    print(f"sync baseline: {steps} steps in {took:.1f} s")


@pytest.mark.timeout(180)
async def test_weights_pushed_during_a_long_request_swap_in_without_pausing_it(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    from rollart.models.loading import load_model_and_tokenizer
    from rollart.protocol import Identity, SessionConfig
    from rollart.protocol.messages import Generate, Generated
    from rollart.weights.config import WeightsSpec
    from rollart.weights.publisher import WeightPublisher

    # trainer and env-0: this test's publisher and client, named in the topology (not started)
    nodes = {"gen-0": "generator", "trainer": "trainer", "env-0": "env-host"}
    cluster = make_cluster(clusters, tmp_path, training_yaml(tiny_model, steps=1), nodes=nodes)
    cluster.start("gen-0")
    await asyncio.to_thread(cluster.wait_status, "gen-0", lambda s: s["engine"]["ready"], 90, "the engine ready")
    port = cluster.ports["gen-0"][0]
    cfg = SessionConfig()
    client = node_client(port, "gen-0")
    publisher = WeightPublisher(Identity("trainer", "trainer"), SECRET, cfg, WeightsSpec(transport="tcp"))
    publisher.add_target("gen-0", "127.0.0.1", port)
    model, tokenizer = await asyncio.to_thread(load_model_and_tokenizer, tiny_model)
    prompt = tokenizer("copy this: abbabaabab\n")["input_ids"]
    n = 600  # long enough for a push to land in the middle, with margin on a busy machine (~0.2 s per 160 here)

    async def generate(request_id: str, max_tokens: int) -> tuple[Generated, float]:
        # Greedy, so the same prompt decodes the same tokens and the two timed requests do equal work.
        request = Generate(request_id, request_id, prompt, max_tokens, temperature=0.0)
        t0 = time.perf_counter()
        reply = await client.request(request, timeout=120)
        assert isinstance(reply, Generated)
        return reply, time.perf_counter() - t0

    def running() -> bool:
        return int(cluster.status("gen-0")["queues"].get("running", 0)) >= 1

    async with asyncio.timeout(150), asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        tg.create_task(publisher.run())
        await generate("warm-up", 8)
        plain, plain_s = await generate("plain", n)
        assert plain.finish_reason == "length" and plain.versions == [0] * n, plain
        swapping = tg.create_task(generate("swapped", n))
        await asyncio.to_thread(wait_for, running, 30, "the long request to be decoding")
        await asyncio.sleep(plain_s / 3)  # a third of the way in, or so
        publisher.publish(1, model.state_dict())  # the same weights, so the tokens are comparable
        swapped, swapped_s = await swapping
        await publisher.wait_delivered(1, timeout=30)
        await publisher.close()
        await client.close()

    versions = swapped.versions
    assert swapped.finish_reason == "length" and len(versions) == len(swapped.token_ids) == n, swapped
    cut = versions.index(1)  # the first token decoded under the new weights
    assert cut > 0 and versions == [0] * cut + [1] * (n - cut), versions
    # Not paused for the push: about as long as the same request without one.
    assert swapped_s < 2.0 * plain_s + 1.0, (swapped_s, plain_s)
    engine = cluster.status("gen-0")["engine"]
    assert engine["version"] == 1 and engine["weights"]["applied"] == 1, engine
    # Greedy under the same weights: the continuation picks up exactly where the first piece stopped.
    assert swapped.token_ids == plain.token_ids
    print(f"long request: {plain_s:.2f} s alone, {swapped_s:.2f} s with a push at token {cut} of {n}")


@pytest.mark.timeout(240)
def test_a_generator_that_misses_versions_catches_up_on_the_newest(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    steps = 6
    cluster = make_cluster(clusters, tmp_path, training_yaml(tiny_model, steps=steps, generate_timeout_s=10))
    started = time.monotonic()
    cluster.start()
    cluster.wait_healthy()
    held = cluster.wait_status("gen-compute", lambda s: receiver_version(s) >= 1, 180, "gen-compute at version 1")
    cluster.signal("gen-compute", signal.SIGSTOP)  # its turns fail over to gen-bandwidth meanwhile
    stopped = time.monotonic()
    frozen_at = receiver_version(held)  # or the next one, if a push landed just before the stop

    def superseded(status: dict[str, Any]) -> bool:
        """Three versions on, and two past what it holds or is being sent: the one between is never sent
        to it (counting from `frozen_at` alone, a push in flight at the stop left only one past it, once)."""
        target = status["training"]["weights"]["gen-compute"]
        sent = max(target["version"], -1 if target["in_flight"] is None else target["in_flight"])
        return bool(status["rollout"]["version"] >= max(frozen_at + 3, sent + 2))

    cluster.wait_status("trainer", superseded, 120, "versions it never gets while it is stopped")
    cluster.signal("gen-compute", signal.SIGCONT)
    stopped_s = time.monotonic() - stopped
    done = trainer_done(cluster, timeout=180)
    final = settle_generators(cluster, steps, timeout=10)
    took = time.monotonic() - started

    engine = final["gen-compute"]
    assert steps - 1 <= engine["weights"]["version"] <= steps, engine
    applied = [r["version"] for r in cluster.events("gen-compute", "weights.applied")]
    # Newest wins: never an older version after a newer one, and the ones pushed while it was
    # stopped were skipped, not queued.
    assert applied == sorted(set(applied)) and applied[-1] == engine["weights"]["version"], applied
    assert engine["weights"]["applied"] == len(applied)
    missed = set(range(1, applied[-1] + 1)) - set(applied)
    assert missed, applied
    pushed = done["training"]["weights"]["gen-compute"]
    assert pushed["skipped"] >= 1, pushed
    print(f"stopped gen-compute for {stopped_s:.1f} s; it applied {applied}; run done in {took:.1f} s")


def latest_checkpoint(run_dir: Path) -> int:
    """The step of the checkpoint the `latest` pointer names (0: none yet)."""
    return RunDir(run_dir).latest_step() or 0


def watch_until_done(cluster: Cluster, timeout: float) -> list[tuple[int, int]]:
    """The trainer's (version, batches) as its /status shows them, every 0.1 s, until it is done."""
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = cluster.status("trainer")
        except OSError:  # not listening yet
            time.sleep(0.1)
            continue
        if "rollout" in status:
            seen.append((status["rollout"]["version"], status["rollout"]["batches"]))
        if status["done"]:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"the trainer was not done after {timeout} s; saw (version, batches) {seen[-5:]}")


def freeze_when(cluster: Cluster, name: str, condition: Any, timeout: float) -> Any:
    """SIGSTOP `name` and return `condition()` if it holds while the node is stopped; else SIGCONT and retry.

    A pause of 0.5 s lets a weight push already on the wire land before `condition` looks. The node
    runs 0.1 s between looks: the tiny model trains a step in tens of milliseconds, and with 0.3 s
    the full suite once saw the trainer go from its step-3 checkpoint to step 6 within one slice."""
    deadline = time.monotonic() + timeout
    while True:
        cluster.signal(name, signal.SIGSTOP)
        time.sleep(0.5)
        if value := condition():
            return value
        cluster.signal(name, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never stopped in the state wanted within {timeout} s")
        time.sleep(0.1)


def resume_run(cluster: Cluster, steps: int, generators_at: Any) -> dict[str, Any]:
    """Run until the trainer has trained two steps; freeze it once `generators_at(versions, checkpoint)`
    holds, kill -9 it there, restart it on the same run folder and watch it to the end.
    Returns what was seen: the checkpoint, the metrics written before the kill, the generators'
    versions at the kill, the resumed trainer's (version, batches) over time."""
    cluster.start()
    cluster.wait_healthy()
    cluster.wait_status("trainer", lambda s: s["rollout"]["batches"] >= 2, 180, "two steps trained")

    looked: list[tuple[float, int, dict[str, int]]] = []

    def ready() -> tuple[int, dict[str, int]] | None:
        checkpoint = latest_checkpoint(cluster.run_dir)
        held = {name: receiver_version(cluster.status(name)) for name in GENERATORS}
        looked.append((round(time.monotonic() - started, 1), checkpoint, held))
        return (checkpoint, held) if generators_at(held, checkpoint) else None

    started = time.monotonic()
    try:
        checkpoint, held = freeze_when(cluster, "trainer", ready, timeout=60)
    except AssertionError as e:
        changes = [seen for i, seen in enumerate(looked) if i == 0 or seen[1:] != looked[i - 1][1:]]
        raise AssertionError(f"{e}; (s, checkpoint, generators' versions) as they changed: {changes}") from None
    cluster.kill("trainer")
    before = cluster.metrics()
    cluster.start("trainer", log_as="trainer-resumed")
    seen = watch_until_done(cluster, timeout=180)
    return {"checkpoint": checkpoint, "before": before, "held": held, "seen": seen}


@pytest.mark.slow  # 70-100 s on a loaded 2-core machine: two trainer start-ups and four steps
@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_run_resumes_from_its_checkpoint(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    steps = 4
    cluster = make_cluster(clusters, tmp_path, training_yaml(tiny_model, steps=steps, checkpoint_every=1))
    started = time.monotonic()
    # Killed where the generators hold the checkpoint's version (see the next test for a newer one).
    run = resume_run(cluster, steps, lambda held, checkpoint: checkpoint >= 1 and set(held.values()) == {checkpoint})
    took = time.monotonic() - started
    k = run["checkpoint"]
    assert 1 <= k < steps

    (resumed,) = cluster.events("trainer", "learner.resumed")
    assert (resumed["step"], resumed["version"]) == (k, k), resumed
    # /status: (0, 0) while the checkpoint loads, then from the checkpoint's step on, never back.
    seen = run["seen"]
    first = next(i for i, pair in enumerate(seen) if pair != (0, 0))
    assert set(seen[:first]) <= {(0, 0)} and seen[first] == (k, k), seen
    assert seen[first:] == sorted(seen[first:]) and seen[-1] == (steps, steps), seen
    assert all(version == batches for version, batches in seen), seen

    # metrics.jsonl: the killed trainer wrote steps 1..m, m being k or k + 1 (a step recorded but not
    # yet checkpointed); the resumed one writes k + 1..steps, no baseline. So the steps only go
    # back once, at the resume, and only to redo the steps since the checkpoint (at most one here).
    before, after = run["before"], cluster.metrics()[len(run["before"]) :]
    assert before[0].get("baseline") and not any(line.get("baseline") for line in after)
    m = len(step_lines(before))
    assert m - k in (0, 1), (k, [line["step"] for line in before])
    check_step_lines(step_lines(before), range(1, m + 1))
    check_step_lines(after, range(k + 1, steps + 1))
    for line in after:
        assert line["staleness_max"] >= 0, line  # no token is newer than the weights trained on
    # The resumed trainer is the run's second: its group ids say so (none can be taken for one the
    # first handed out), and so do its timeline lines, which tell which steps the model descends from.
    assert RunDir(cluster.run_dir).incarnation.read_text().strip() == "1"
    timeline = cluster.timeline()
    second = [row for row in timeline if row["incarnation"] == 1]
    assert {row["incarnation"] for row in timeline} == {0, 1}
    assert sorted({row["step"] for row in second}) == list(range(k + 1, steps + 1))
    assert all(row["group_id"].startswith("i1.") for row in second), second

    # Every generator held the checkpoint's weights at the resume (the trainer pushes its version
    # to any that lacks it); then each new version reached them.
    connected: dict[str, int] = {}
    for record in cluster.events("trainer", "weights.connected"):
        connected.setdefault(record["target"], record["holds"])  # each one's first connection
    assert connected == dict.fromkeys(GENERATORS, k), connected
    final = settle_generators(cluster, steps, timeout=10)
    for name, engine in final.items():
        assert steps - 1 <= engine["weights"]["version"] <= steps, (name, engine)
        applied = [r["version"] for r in cluster.events(name, "weights.applied")]
        assert applied == sorted(set(applied)) and applied[-1] == engine["weights"]["version"], applied
    print(f"resume: checkpoint {k}, done in {took:.1f} s")


@pytest.mark.timeout(300)
def test_generators_ahead_of_the_checkpoint_get_its_weights_under_a_fresh_version(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    steps = 6
    # alpha 0: each step waits for a whole batch started at its version, so the moment wanted below
    # (the generators hold 4 or 5, the checkpoint is still 3) lasts two rollouts and two steps. The
    # freeze loop lets the trainer run 0.1 s at a time (with 0.3 s the full suite once missed it);
    # with a checkpoint every 2 steps the moment was one rollout, which a fast machine finished
    # within one such slice (missed in CI).
    yaml = training_yaml(tiny_model, steps=steps, alpha=0, checkpoint_every=3)
    cluster = make_cluster(clusters, tmp_path, yaml)
    # Killed after version 4 reached the generators and before step 6's checkpoint: they hold a
    # version newer than the one the trainer resumes at (3), made by weights that are now lost.
    run = resume_run(cluster, steps, lambda held, checkpoint: 1 <= checkpoint < min(held.values()))
    k = run["checkpoint"]
    (resumed,) = cluster.events("trainer", "learner.resumed")
    assert resumed["version"] == k < min(run["held"].values()), (resumed, run["held"])
    # Versions never go back: the checkpoint's weights get the next version above every generator's.
    (ahead,) = cluster.events("trainer", "trainer.generators_ahead")
    fresh = max(run["held"].values()) + 1
    assert (ahead["checkpoint_version"], ahead["new_version"]) == (k, fresh), ahead
    for name in GENERATORS:
        pushed = [r["version"] for r in cluster.events("trainer", "weights.pushed") if r["target"] == name]
        assert pushed and pushed[0] == fresh, (name, pushed)
    final_version = fresh + (steps - k)
    assert run["seen"][-1] == (final_version, steps), run["seen"][-5:]
    final = settle_generators(cluster, final_version, timeout=10)
    assert all(final_version - 1 <= engine["version"] <= final_version for engine in final.values()), final
    # The redone steps trained on tokens of the resumed weights or older, never on the lost ones.
    for line in cluster.metrics()[len(run["before"]) :]:
        assert line["staleness_max"] >= 0 and line["staleness_mean"] >= 0, line


@pytest.mark.timeout(300)
def test_fsdp_training_run_with_two_ranks_checkpoints_and_exits_cleanly(
    tmp_path: Path, tiny_model: Path, clusters: list[Cluster]
) -> None:
    """The trainer node drives two FSDP2 rank processes: every step trains, every version reaches the
    generators, each checkpoint is written in the background and is whole, and the ranks exit with it."""
    steps = 3
    yaml = training_yaml(tiny_model, steps=steps, checkpoint_every=1, trainer="backend: fsdp2, ranks: 2")
    # Batches of two groups of two often have no signal at all, and then no step trains: ask for signal.
    yaml = yaml.replace("    group_size: 2\n", "    group_size: 2\n    dynamic_sampling: true\n")
    cluster = make_cluster(clusters, tmp_path, yaml)
    cluster.start()
    cluster.wait_healthy()
    done = trainer_done(cluster, timeout=240)
    assert done["rollout"]["version"] == done["rollout"]["batches"] == steps
    lines = step_lines(cluster.metrics())
    check_step_lines(lines, range(1, steps + 1))
    trained = [line for line in lines if line["tokens"] > 0]  # a batch without signal takes no step
    assert trained, lines
    for line in trained:
        assert line["state_bytes_r0"] > 0 and line["state_bytes_r1"] > 0 and line["peak_bytes_r1"] > 0, line
    final = settle_generators(cluster, steps, timeout=10)
    assert all(steps - 1 <= engine["weights"]["version"] <= steps for engine in final.values()), final
    assert latest_checkpoint(cluster.run_dir) == steps
    assert (RunDir(cluster.run_dir).latest_checkpoint() / "dcp" / ".metadata").exists()
    saved = cluster.events("trainer", "learner.checkpoint")
    assert [event["step"] for event in saved] == list(range(1, steps + 1)), saved
    ranks = cluster.events("trainer", "ranks.started")[0]["pids"]
    assert cluster.stop() == dict.fromkeys(NODES, 0)
    for pid in ranks:  # the ranks left with their node
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
