"""The trainer node's training engine, from start to close: build or resume it, step it, publish its weights,
checkpoint it.

Per batch: group-relative advantages and one `train_step` in a worker thread (the node keeps serving
env-hosts meanwhile), then the export of the new weights ordered before the next step (`begin_export`, cast to
the dtype the generators take: `GeneratorTargets`; the only wait), handed to the `WeightPublisher` in the
background once it is out. Checkpoints go to `RunDir.checkpoint(step)`
(the engine's state, and the trainer state: version, step, elapsed time, RNG and dispenser state); the
`latest` pointer names the newest complete one, so a kill -9 mid-save leaves the previous one usable.

It knows no node and writes no records: the trainer node hands it the run folder, the publisher and its
targets, and a function that builds the engine; the step's records are `rollart.tracking.records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollart.algorithms.selection import select_groups
from rollart.errors import RollartError
from rollart.protocol.messages import GroupDone
from rollart.rundir import RunDir

if TYPE_CHECKING:
    import torch

    from rollart.training.engine import TrainingEngine
    from rollart.training.spec import TrainerSpec
    from rollart.weights.generators import GeneratorTargets
    from rollart.weights.publisher import WeightPublisher

log = structlog.get_logger("rollart.learner")

BY_GENERATOR = "mismatch_kl/"
"""A step's metrics key prefix of each generator's mismatch KL (`name_sources`)."""


class Learner:
    """Trains on the batches the trainer node takes, and publishes the weights."""

    def __init__(
        self,
        spec: TrainerSpec,
        *,
        run_dir: RunDir,
        targets: GeneratorTargets,
        build_engine: Callable[[], TrainingEngine],
        temperature: float = 1.0,
    ) -> None:
        """`targets` holds the publisher and the generators it pushes to; `build_engine` blocks (it runs in a
        worker thread); `temperature`: what the generators sample at (`run.rollout.sampling.temperature`), which
        the trainer's log-probs apply."""
        self.spec = spec
        self.temperature = temperature
        self.run_dir = run_dir
        self.targets = targets
        self.publisher: WeightPublisher = targets.publisher
        self._build_engine = build_engine
        self.engine: TrainingEngine | None = None
        self.engine_info: dict[str, Any] = {}
        """The engine's `describe()`, once it is built (in `/status`: its rank processes' pids)."""
        self.stall_s: list[float] = []
        """Per version published: the seconds the trainer waited for its export (`publish`)."""
        self._step_stall_s = 0.0
        """What the weight push held the trainer in the current step: the wait for the last version's packer and
        export, and ordering this version's export (the step's metrics line: `stall_s`)."""
        self._publishing: asyncio.Task[None] | None = None
        """The last version's push being started (its export awaited, then handed to the publisher)."""
        self._exported_at: asyncio.Future[float] | None = None
        """When the last export was out (`time.perf_counter()`), for the next step's wait behind it."""
        self._links_counted = (0, 0)  # the publisher's (link_bytes, link_whole_bytes) at the last record
        self._saving: asyncio.Task[None] | None = None

    # -- start and resume -------------------------------------------------------------------------

    async def start(self) -> dict[str, Any] | None:
        """Build the engine; load the newest checkpoint if there is one and return its trainer state."""
        self.engine = await asyncio.to_thread(self._build_engine)
        self.engine_info = self.engine.describe()
        latest = self.latest_checkpoint()
        if latest is None:
            log.info("learner.ready", **self.engine_info)
            return None
        state = await asyncio.to_thread(self._load, latest)
        log.info("learner.resumed", checkpoint=str(latest), step=state["step"], version=state["version"])
        return state

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

        generators = sorted({g for group in batch for t in group.trajectories for g in t.generators})
        if self._publishing is not None and self._publishing.done():
            self._publishing.result()  # a push that could not start (a rank died in the export) fails the step
        self._step_stall_s = 0.0

        def step() -> dict[str, Any]:
            # The last version's packer may still read the weights: the optimizer must not change them yet.
            if self.stall_s:
                self._held(self.publisher.wait_packed())

            advantages = ragged_group_advantages(rewards, normalize_std=cfg.normalize_std, eps=cfg.adv_eps)
            counts = {
                "groups_trained": float(len(chosen.signal)),
                "groups_without_signal": float(chosen.without_signal),
            }
            if not chosen.trained:
                everything = [t for group in batch for t in group.trajectories]
                packed = pack_batch(
                    everything,
                    [0.0] * len(everything),
                    pad_id=engine.pad_id,
                    temperature=self.temperature,
                    generators=generators,
                )
                skipped = {"loss": 0.0, "policy_loss": 0.0, "grad_norm": 0.0, "tokens": 0.0, "train_s": 0.0}
                return counts | skipped | staleness(packed.versions, packed.loss_mask, version)
            trajectories = [t for i in chosen.trained for t in batch[i].trajectories]
            trained = [a for i in chosen.trained for a in advantages[i]]
            packed = pack_batch(
                trajectories, trained, pad_id=engine.pad_id, temperature=self.temperature, generators=generators
            )
            return counts | engine.train_step(packed, version=version)

        sent = time.perf_counter()
        stats = name_sources(await asyncio.to_thread(step), generators)
        self._watch_mismatch(stats, [t for group in batch for t in group.trajectories], version)
        if self._exported_at is not None:  # the step ran after the export: what it waited for it is the push's
            exported_at, self._exported_at = await self._exported_at, None
            self._held(max(0.0, exported_at - sent))
        return stats

    def _watch_mismatch(self, stats: dict[str, Any], trajectories: list[Any], version: int) -> None:
        """Warn when generators and trainer disagree on tokens of the trainer's own version: a generator's own KL
        (`mismatch_kl/<generator>`) or the batch's (`mismatch_kl`) past the threshold, naming the generators past
        it (or, where no token's generator is known, those that served trajectories holding such tokens)."""
        kl, threshold = stats.get("mismatch_kl"), self.spec.mismatch_warn_kl
        by_generator = {key.removeprefix(BY_GENERATOR): v for key, v in stats.items() if key.startswith(BY_GENERATOR)}
        served = sorted(name for name, value in by_generator.items() if value > threshold)
        if kl is None or threshold <= 0 or (not served and kl <= threshold):
            return  # one bad generator among many good ones still warns: its own KL passed
        if not served:
            served = sorted({g for t in trajectories if version in t.versions for g in t.generators})
        log.warning(
            "trainer.mismatch",
            kl=round(kl, 6),
            ratio_max=round(stats.get("mismatch_ratio_max", 0.0), 4),
            share=round(stats.get("mismatch_frac", 0.0), 3),
            threshold=threshold,
            generators=served,
            why="the generators' log-probs of tokens from the trainer's own weights differ from the trainer's: "
            "their weights or numerics differ (a weight sync gone wrong, a wrong name mapping, a dtype change)",
        )

    async def publish(self, version: int) -> None:
        """Order the export of the weights before the next step and start the push once they are out.

        What holds the trainer is only what keeps a version whole: sending the export to the ranks (fsdp2,
        megatron: they gather and write the weights into shared memory while the node goes on; the next step
        runs after it) or the cast (torch). The push starts in the background once the weights are out, after
        the push before it. The trainer's stall for this version (`stall_s`) is that, plus what the next step
        waits for the export and for the packer, counted when that step runs."""
        assert self.engine is not None
        engine = self.engine
        self.targets.follow()
        started = time.perf_counter()
        dtype = self.targets.wire_dtype()  # the generators' dtype: cast in the export, on the trainer's device
        exporting = await asyncio.to_thread(engine.begin_export, dtype)
        self.stall_s.append(0.0)
        self._held(time.perf_counter() - started)
        self._exported_at = asyncio.ensure_future(_done_at(exporting))
        before = self._publishing
        self._publishing = asyncio.create_task(
            self._push(version, exporting, engine.exports_copies(dtype), before), name=f"publish-v{version}"
        )
        self._publishing.add_done_callback(functools.partial(_say_if_push_failed, version))

    async def _push(
        self,
        version: int,
        exporting: Future[dict[str, torch.Tensor]],
        owned: bool,
        before: asyncio.Task[None] | None,
    ) -> None:
        if before is not None:
            await before  # versions go out in order
        weights = await asyncio.wrap_future(exporting)
        await asyncio.to_thread(self.publisher.publish, version, weights, owned=owned)

    def _held(self, seconds: float) -> None:
        """Count `seconds` the push held the trainer: to the last version published, and to this step."""
        self.stall_s[-1] += seconds
        self._step_stall_s += seconds

    def push_record(self) -> dict[str, float]:
        """The weight push's numbers for the step's metrics line: the trainer's stall, the last push to each
        generator (the slowest), and what the links carried since the last call (and would have, whole)."""
        pushes = [s.last_push_s for s in self.publisher.stats().values() if s.pushes]
        links = (self.publisher.link_bytes, self.publisher.link_whole_bytes)
        record = {
            "stall_s": self._step_stall_s,
            "time_push_s": round(max(pushes, default=0.0), 6),
            "weight_link_bytes": links[0] - self._links_counted[0],
            "weight_link_whole_bytes": links[1] - self._links_counted[1],
        }
        self._links_counted = links
        return record

    # -- checkpoints ------------------------------------------------------------------------------

    async def checkpoint(self, *, step: int, version: int, elapsed_s: float, dispenser: dict[str, Any]) -> Path:
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
            "elapsed_s": elapsed_s,
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
        """Finish the checkpoint in flight and stop the engine (its rank processes); a push not started yet is
        let go (the publisher is closing too)."""
        if self._publishing is not None and not self._publishing.done():
            self._publishing.cancel()
        try:
            await self.saved()
        finally:
            if self.engine is not None:
                await asyncio.to_thread(self.engine.close)


def _say_if_failed(path: Path, saving: asyncio.Task[None]) -> None:
    """Log a checkpoint whose write failed (a rank died under it) when it happens, even if nothing
    waits for it any more (the node failing for the same reason); `latest` still names the one before."""
    if not saving.cancelled() and (error := saving.exception()) is not None:
        log.error("learner.checkpoint_failed", path=str(path), error=f"{type(error).__name__}: {error}")


def _say_if_push_failed(version: int, publishing: asyncio.Task[None]) -> None:
    """Log a version whose push could not start (its export failed: a rank died) when it happens; the next step
    raises it too (`Learner.train`)."""
    if not publishing.cancelled() and (error := publishing.exception()) is not None:
        log.error("learner.publish_failed", version=version, error=f"{type(error).__name__}: {error}")


async def _done_at(exporting: Future[Any]) -> float:
    """When `exporting` completed (`time.perf_counter()`), whether or not it failed (the push says why)."""
    with contextlib.suppress(Exception):
        await asyncio.wrap_future(exporting)
    return time.perf_counter()


def name_sources(stats: dict[str, Any], generators: list[str]) -> dict[str, Any]:
    """`stats` with the mismatch monitor's per-source KLs (`SOURCE_KL`, by index into `generators`) under the
    generators' names: `mismatch_kl/<generator>`, the KL on its tokens of the step's own version."""
    from rollart.algorithms.stats import SOURCE_KL

    return {
        f"{BY_GENERATOR}{generators[int(key.removeprefix(SOURCE_KL))]}" if key.startswith(SOURCE_KL) else key: value
        for key, value in stats.items()
    }
