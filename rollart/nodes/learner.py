"""The training half of the trainer node: engine, weight push, checkpoints and the run's records.

Per batch: group-relative advantages, one `train_step` in a worker thread (the node keeps serving
env-hosts meanwhile), a snapshot of the new weights handed to the `WeightPublisher` (the only
wait: a copy), and a line in the run folder's metrics (copied to TensorBoard and any other tracker
`run.tracking` names: `rollart.tracking`) plus one per trajectory in its timeline
(`rollart.rundir.RunDir`). Checkpoints go to `RunDir.checkpoint(step)` (a loadable Hugging Face
folder, optimizer state, and the trainer state: version, step, RNG and dispenser state); the
`latest` pointer names the newest complete one, so a kill -9 mid-save leaves the previous one usable.

It knows no node: the trainer node hands it what it uses (the run folder, a weight publisher, a
function that builds the training engine, the generators and their sessions, the status they
report), so it can be built and driven alone.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import random
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollart.algorithms.selection import select_groups
from rollart.errors import ConfigError, RollartError
from rollart.protocol.messages import GroupDone, NodeStatus, WeightsWhere
from rollart.protocol.retry import Backoff, retry
from rollart.rundir import JsonlLog, RunDir
from rollart.tracking import Tracker

if TYPE_CHECKING:
    import torch

    from rollart.protocol import ClientSession
    from rollart.rollout.config import TaskSpec
    from rollart.topology import NodeSpec
    from rollart.tracking import TrackingSpec
    from rollart.training.engine import TrainingEngine
    from rollart.training.spec import TrainerSpec
    from rollart.weights import WeightPublisher

log = structlog.get_logger("rollart.learner")

MOVING_AVERAGE = 20
"""Steps in the moving averages of success and reward shown in progress and the report."""


class Learner:
    """Trains on batches the trainer node takes, and pushes the weights to generators."""

    def __init__(
        self,
        spec: TrainerSpec,
        *,
        run_dir: RunDir,
        publisher: WeightPublisher,
        build_engine: Callable[[], TrainingEngine],
        generators: Sequence[NodeSpec],
        clients: Mapping[str, ClientSession],
        peer_status: Mapping[str, NodeStatus],
        tasks: Sequence[TaskSpec],
        seed: int,
        tracking: TrackingSpec | None = None,
    ) -> None:
        """`build_engine` blocks (it runs in a worker thread); `clients` has a session to each of
        `generators`; `peer_status` is the live map of the status peers last reported; `tasks` and
        `seed` are the run's, for the random-policy baseline; `tracking` (`run.tracking`) names the
        trackers that get each metrics line too (None: none, for a learner built alone)."""
        self.spec = spec
        self.run_dir = run_dir
        self.publisher = publisher
        self._build_engine = build_engine
        self._generators = list(generators)
        self._clients = clients
        self._peer_status = peer_status
        self._tasks = list(tasks)
        self._seed = seed
        self.metrics = JsonlLog(run_dir.metrics)
        self.timeline = JsonlLog(run_dir.timeline)
        self.utilization = JsonlLog(run_dir.utilization)
        self.tracker = Tracker.from_spec(tracking, run_dir) if tracking is not None else None
        self.engine: TrainingEngine | None = None
        self.engine_info: dict[str, Any] = {}
        """The engine's `describe()`, once it is built (in `/status`: its rank processes' pids)."""
        self.epoch_start = time.time()
        """Wall-clock time the run started (moved back by the elapsed time of a resumed run)."""
        self.last_step_at = time.monotonic()
        self.last_stats: dict[str, Any] = {}
        self.stall_s: list[float] = []
        self._links_counted = (0, 0)  # the publisher's (link_bytes, link_whole_bytes) at the last record
        self.baseline: dict[str, dict[str, float]] = {}
        """Per task: the uniformly random valid policy's success rate and reward, measured at the start."""
        self._recent: dict[str, collections.deque[tuple[float, float]]] = {}
        self._busy: dict[str, tuple[float, float]] = {}
        self._ucx_ports: dict[str, int] = {}
        self._dtypes: dict[str, torch.dtype | None] = {}
        self._saving: asyncio.Task[None] | None = None

    # -- start and resume -------------------------------------------------------------------------

    async def start(self) -> dict[str, Any] | None:
        """Build the engine; load the newest checkpoint if there is one and return its trainer state."""
        self.engine = await asyncio.to_thread(self._build_engine)
        self.engine_info = self.engine.describe()
        latest = self.latest_checkpoint()
        if latest is None:
            if self.tracker is not None:
                self.tracker.starts_at(0)  # what an earlier life logged before its first checkpoint is gone
            log.info("learner.ready", **self.engine_info)
            self.baseline = await asyncio.to_thread(self._measure_baseline)
            self.write_metrics({"baseline": True, "tasks": self.baseline})
            return None
        state = await asyncio.to_thread(self._load, latest)
        if self.tracker is not None:
            self.tracker.starts_at(int(state["step"]) + 1)
        self.epoch_start = time.time() - float(state["elapsed_s"])
        log.info("learner.resumed", checkpoint=str(latest), step=state["step"], version=state["version"])
        return state

    def _measure_baseline(self) -> dict[str, dict[str, float]]:
        from rollart.tiny.warmup import random_policy_baseline

        baseline = {}
        for task in self._tasks:
            try:
                measured = random_policy_baseline(task, seed=self._seed)
            except ConfigError as exc:  # a user's env: registered by run.env_modules on env-hosts only
                log.info("learner.no_baseline", task=task.name, reason=str(exc))
                continue
            if measured is not None:
                baseline[task.name] = measured
                log.info("learner.baseline", task=task.name, policy="uniformly random valid actions", **measured)
        return baseline

    def claim_incarnation(self) -> int:
        """How many trainer processes of this run started before this one (`RunDir.incarnation`,
        counted up at each start). Group ids carry it: a trainer that dies before its
        first checkpoint, or twice after the same one, would otherwise hand out the ids its last
        life did, and take a group still coming home from that life for a different one."""
        path = self.run_dir.incarnation
        started = int(path.read_text()) + 1 if path.exists() else 0
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(f"{started}\n")
        scratch.replace(path)
        return started

    def latest_checkpoint(self) -> Path | None:
        path = self.run_dir.latest_checkpoint()
        if path is not None and not self.run_dir.trainer_state(path).exists():
            raise RollartError(f"{self.run_dir.latest} names {path}, which is not a complete checkpoint")
        return path

    def _load(self, path: Path) -> dict[str, Any]:
        import torch

        assert self.engine is not None
        self.engine.load(path)
        state: dict[str, Any] = torch.load(self.run_dir.trainer_state(path), weights_only=False)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        return state

    async def connect_generators(self) -> int:
        """Ask every generator where to push weights (and in which dtype), and add it as a publisher
        target; returns the newest version any of them holds."""
        from rollart.weights.buckets import wire_dtype

        held = 0
        for spec in self._generators:
            client = self._clients[spec.name]
            here = await retry(
                functools.partial(client.request, WeightsWhere(), timeout=client.cfg.probe_timeout_s),
                what=f"the weights address of generator {spec.name}",
                retry_on=(RollartError,),
                backoff=Backoff.for_retries(client.cfg),
                deadline_s=client.cfg.retry_deadline_s,
            )
            self._dtypes[spec.name] = wire_dtype(here.dtype, what=f"generator {spec.name}'s weights")
            self._add_target(spec, here.ucx_port)
            self._ucx_ports[spec.name] = here.ucx_port
            held = max(held, here.version)
        return held

    def _add_target(self, spec: NodeSpec, ucx_port: int) -> None:
        self.publisher.add_target(
            spec.name,
            spec.host,
            spec.port,
            ucx_port=ucx_port or None,
            dtype=self._dtypes.get(spec.name),
            place=f"{spec.cluster}/{spec.host}",
        )

    def _follow_generators(self) -> None:
        """A restarted generator listens for UCX on a new port (push there from now on) and may hold
        an older version than it last acknowledged (it gets the latest again), as its status says."""
        generators = {spec.name: spec for spec in self._generators}
        for name, status in self._peer_status.items():
            if name not in self._ucx_ports or not isinstance(status, NodeStatus) or "ucx_port" not in status.load:
                continue
            port = int(status.load["ucx_port"])
            if port != self._ucx_ports[name]:
                self.publisher.remove_target(name)
                self._add_target(generators[name], port)
                self._ucx_ports[name] = port
                log.info("learner.generator_moved", generator=name, ucx_port=port)
            if "version" in status.load:
                self.publisher.report_holding(name, int(status.load["version"]))

    # -- a step -----------------------------------------------------------------------------------

    async def train(self, batch: list[GroupDone], *, version: int) -> dict[str, Any]:
        """One training step on `batch`, taken at policy `version`; returns its statistics.

        Only the groups `rollart.algorithms.selection.select_groups` picks are trained on: those with
        signal, plus up to `grpo.anchor_groups` anchors when `grpo.anchor_coef > 0`. A batch with no
        signal at all takes no optimizer step, since AdamW's momentum would still move the weights on
        a zero gradient (`rollout.dynamic_sampling` also has the buffer fill the batch with groups
        that have signal).
        """
        from rollart.algorithms.grpo import pack_batch, ragged_group_advantages, staleness

        assert self.engine is not None
        engine = self.engine
        cfg = self.spec.grpo
        rewards = [[t.reward for t in group.trajectories] for group in batch]
        chosen = select_groups(rewards, anchors=cfg.anchor_groups if cfg.anchor_coef > 0 else 0)

        def step() -> dict[str, Any]:
            # The last version's packer may still read the weights: the optimizer must not change them yet.
            if self.stall_s:
                self.stall_s[-1] += self.publisher.wait_packed()

            advantages = ragged_group_advantages(rewards, normalize_std=cfg.normalize_std, eps=cfg.adv_eps)
            counts = {
                "groups_trained": float(len(chosen.signal)),
                "groups_without_signal": float(chosen.without_signal),
            }
            if not chosen.trained:
                everything = [t for group in batch for t in group.trajectories]
                packed = pack_batch(everything, [0.0] * len(everything), pad_id=engine.pad_id)
                skipped = {"loss": 0.0, "policy_loss": 0.0, "grad_norm": 0.0, "tokens": 0.0, "train_s": 0.0}
                return counts | skipped | staleness(packed.versions, packed.loss_mask, version)
            trajectories = [t for i in chosen.trained for t in batch[i].trajectories]
            packed = pack_batch(trajectories, [a for i in chosen.trained for a in advantages[i]], pad_id=engine.pad_id)
            return counts | engine.train_step(packed, version=version)

        return await asyncio.to_thread(step)

    def publish(self, version: int) -> float:
        """Export the weights (from the ranks, with FSDP2) and start the push; returns the seconds the
        trainer waited for both (its stall; the next step adds any wait for the packer to finish)."""
        assert self.engine is not None
        self._follow_generators()
        started = time.perf_counter()
        wire = set(self._dtypes.values())
        dtype = wire.pop() if len(wire) == 1 else None  # the generators' dtype: cast in the export
        weights = self.engine.export_weights(dtype)
        owned = self.engine.exports_copies(dtype)
        stall = time.perf_counter() - started + self.publisher.publish(version, weights, owned=owned)
        self.stall_s.append(stall)
        return stall

    def record(
        self, step: int, version: int, batch: list[GroupDone], stats: dict[str, Any], *, incarnation: int
    ) -> dict[str, Any]:
        """Write the step's metrics and its trajectories' timeline (whose lines name the trainer's
        `incarnation`, the dispenser's); return the metrics line."""
        now = time.monotonic()
        trajectories = [t for group in batch for t in group.trajectories]
        tasks: dict[str, dict[str, Any]] = {}
        for task in sorted({t.task for t in trajectories}):
            mine = [t for t in trajectories if t.task == task]
            tasks[task] = {
                "reward_mean": sum(t.reward for t in mine) / len(mine),
                "success_rate": sum(t.success for t in mine) / len(mine),
                "count": len(mine),
            }
        for task, numbers in tasks.items():
            recent = self._recent.setdefault(task, collections.deque(maxlen=MOVING_AVERAGE))
            recent.append((numbers["success_rate"], numbers["reward_mean"]))
            numbers["success_ma"] = sum(s for s, _ in recent) / len(recent)
            numbers["reward_ma"] = sum(r for _, r in recent) / len(recent)
        elapsed = time.time() - self.epoch_start
        line = {
            "step": step,
            "elapsed_s": round(elapsed, 3),
            "version": version,
            "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
            "success_rate": sum(t.success for t in trajectories) / len(trajectories),
            "tasks": tasks,
            "traj_per_s": len(trajectories) / max(now - self.last_step_at, 1e-9),
            "generator_busy": self.generator_busy(),
            "stall_s": self.stall_s[-1] if self.stall_s else 0.0,
            **{key: round(value, 6) for key, value in stats.items()},
        }
        if cut := sum(1 for group in batch if group.cut):
            line["groups_cut"] = cut  # finished short at their deadline (`rollout.min_group_size`)
        line |= self._elsewhere(trajectories)
        links = (self.publisher.link_bytes, self.publisher.link_whole_bytes)
        line["weight_link_bytes"] = links[0] - self._links_counted[0]
        line["weight_link_whole_bytes"] = links[1] - self._links_counted[1]
        self._links_counted = links
        self.last_step_at = now
        self.last_stats = line
        self.write_metrics(line)
        self.timeline.write(self._timeline(step, version - 1, trajectories, incarnation))
        return line

    def write_metrics(self, line: dict[str, Any]) -> None:
        """A line of metrics.jsonl, handed to the trackers too (which write it on a thread of theirs)."""
        self.metrics.write([line])
        if self.tracker is not None:
            self.tracker.log(line)

    def _elsewhere(self, trajectories: list[Any]) -> dict[str, float]:
        """The step's time outside the train step: the weights' way to the generators (the last push
        to each, the slowest; the generators' last apply, the slowest) and, per trajectory of the
        batch on average, its generation, env and reward time and its whole length."""
        pushes = [s.last_push_s for s in self.publisher.stats().values() if s.pushes]
        applies = [
            float(status.load["apply_s"])
            for status in self._peer_status.values()
            if isinstance(status, NodeStatus) and "apply_s" in status.load
        ]
        spent = dict.fromkeys(("gen", "env", "reward"), 0.0)
        for t in trajectories:
            for kind, start, end in t.spans:
                if kind in spent:
                    spent[kind] += end - start
        n = max(len(trajectories), 1)
        return {
            "time_push_s": round(max(pushes, default=0.0), 6),
            "time_apply_s": round(max(applies, default=0.0), 6),
            **{f"traj_{kind}_s": round(total / n, 6) for kind, total in spent.items()},
            "traj_s": round(sum(t.finished_at - t.started_at for t in trajectories) / n, 6),
        }

    def _timeline(
        self, step: int, taken_at: int, trajectories: list[Any], incarnation: int
    ) -> Iterable[dict[str, Any]]:
        """One line per trained trajectory: what the run report draws, and what a fault-injection
        run's checks need (which group and seed it ran, the version it started at, the version its
        batch was taken at, `taken_at`, and the trainer's incarnation: a trainer resumed from a
        checkpoint trains the later steps again, and the last incarnation's lines are the ones the
        model descends from)."""
        t0 = self.epoch_start
        for t in trajectories:
            yield {
                "incarnation": incarnation,
                "trajectory_id": t.trajectory_id,
                "group_id": t.group_id,
                "task": t.task,
                "seed": t.seed,
                "step": step,
                "started_at_version": t.started_at_version,
                "taken_at_version": taken_at,
                "generators": sorted(set(t.generators)),
                "started_at": round(t.started_at - t0, 4),
                "finished_at": round(t.finished_at - t0, 4),
                "spans": [[kind, round(a - t0, 4), round(b - t0, 4)] for kind, a, b in t.spans],
            }

    def generator_busy(self) -> dict[str, float]:
        """Each generator's busy fraction since the last call, from the status peers report."""
        busy: dict[str, float] = {}
        samples = []
        elapsed = round(time.time() - self.epoch_start, 3)
        for name, status in self._peer_status.items():
            if not isinstance(status, NodeStatus) or "busy_s" not in status.load:
                continue
            busy_s, up_s = status.load["busy_s"], status.load["engine_up_s"]
            prev_busy, prev_up = self._busy.get(name, (0.0, 0.0))
            if up_s < prev_up:  # the generator restarted
                prev_busy, prev_up = 0.0, 0.0
            if up_s > prev_up:
                busy[name] = round(min(1.0, (busy_s - prev_busy) / (up_s - prev_up)), 4)
                samples.append({"t": elapsed, "generator": name, "busy": busy[name]})
            self._busy[name] = (busy_s, up_s)
        self.utilization.write(samples)
        return busy

    # -- checkpoints ------------------------------------------------------------------------------

    async def checkpoint(self, *, step: int, version: int, dispenser: dict[str, Any]) -> Path:
        """Start a checkpoint of everything a restart needs; returns once training may go on.

        The engine stages its state and may write it in the background (`TrainingEngine.save`);
        the trainer state and the `latest` pointer follow once the engine's part is whole, so a
        kill -9 before then leaves the previous checkpoint as the latest. One is written at a time:
        a checkpoint first waits for the one before (`saved`)."""
        import torch

        assert self.engine is not None
        await self.saved()
        engine = self.engine
        path = self.run_dir.checkpoint(step)
        state = {
            "step": step,
            "version": version,
            "elapsed_s": time.time() - self.epoch_start,
            "dispenser": dispenser,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        started = time.monotonic()
        written = await asyncio.to_thread(engine.save, path)
        held = round(time.monotonic() - started, 3)
        self._saving = asyncio.create_task(self._finish_checkpoint(path, written, state, started, held))
        self._saving.add_done_callback(functools.partial(_say_if_failed, path))
        return path

    async def _finish_checkpoint(
        self, path: Path, written: Future[None], state: dict[str, Any], started: float, held: float
    ) -> None:
        import torch

        run_dir = self.run_dir
        await asyncio.wrap_future(written)

        def finish() -> None:
            torch.save(state, run_dir.trainer_state(path))
            run_dir.point_latest_at(path)
            for old in run_dir.saved_checkpoints()[: -self.spec.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)

        await asyncio.to_thread(finish)
        took = round(time.monotonic() - started, 3)
        log.info(
            "learner.checkpoint", path=str(path), step=state["step"], version=state["version"], s=took, held_s=held
        )

    async def saved(self) -> None:
        """Wait for the checkpoint being written, if any (raises what its write raised)."""
        saving, self._saving = self._saving, None
        if saving is not None:
            await saving

    async def watch_engine(self) -> None:
        """Raise as soon as the engine breaks between calls (`TrainingEngine.failed`: a rank process
        died while the trainer waited for a batch), so the node fails then; returns at once for an
        engine that nothing outside a call can break."""
        assert self.engine is not None
        failed = self.engine.failed()
        if failed is not None:
            await asyncio.wrap_future(failed)

    async def close(self) -> None:
        """Finish the checkpoint in flight, stop the engine (its rank processes) and end the trackers' runs."""
        try:
            await self.saved()
        finally:
            try:
                if self.engine is not None:
                    await asyncio.to_thread(self.engine.close)
            finally:
                await self.close_trackers()

    async def close_trackers(self) -> None:
        """End the trackers' runs (W&B, MLflow: finished) once their lines are written; also when
        the trainer drains mid-run, which ends its work without `close`. Lines after it go to
        metrics.jsonl alone."""
        if self.tracker is not None:
            await asyncio.to_thread(self.tracker.close)


def _say_if_failed(path: Path, saving: asyncio.Task[None]) -> None:
    """Log a checkpoint whose write failed (a rank died under it) when it happens, even if nothing
    waits for it any more (the node failing for the same reason); `latest` still names the one before."""
    if not saving.cancelled() and (error := saving.exception()) is not None:
        log.error("learner.checkpoint_failed", path=str(path), error=f"{type(error).__name__}: {error}")
