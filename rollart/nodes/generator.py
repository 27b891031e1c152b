"""The generator node: an inference engine of one hardware class, serving generation requests.

Env-hosts send `Generate` requests; the engine batches every request in flight (transformers,
vLLM, or in simulation mode a `SimEngine`: `run.generator.backend`). A request whose caller gives up (timeout, a
redundant trajectory cancelled, a stale trajectory aborted) is cancelled here too, which aborts
it in the engine; the aborts are counted in `/status`.

Weights arrive from the trainer on bulk connections (TCP to the session port, or UCX to the
port `WeightsHere` names) into a `WeightReceiver`, which hands each complete version to the
engine's `load_weights`: requests in flight keep going and finish under the new version. A
request whose `min_version` is newer than the weights held waits for the push.

Under LoRA (`run.trainer.lora`) the base model never changes: every engine loads it from `run.model.path`
at start (a generator that joins late or restarts too), and a pushed version holds the adapters only, which
go to the engine's `load_adapter` (vLLM serves them as LoRA adapters; the transformers engine merges them).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any

import msgspec
import structlog

from rollart import cpus
from rollart.errors import ConfigError
from rollart.generation.engine import EngineClosed, RecentBusy, SamplingParams
from rollart.generation.engine_set import EngineSet, slices
from rollart.generation.registry import EngineSite, EngineSlot
from rollart.generation.registry import backend as generation_backend
from rollart.models.checkpoint import engine_dtype
from rollart.nodes.base import NodeDaemon
from rollart.protocol import Connection, Identity, Session
from rollart.protocol.errors import ProtocolError, RemoteError
from rollart.protocol.messages import Generate, Generated, SimWeights, WeightsHere, WeightsWhere
from rollart.topology import RunSpec
from rollart.topology.roles import Role
from rollart.weights.receiver import WeightReceiver
from rollart.weights.ucx import ucx_unavailable

log = structlog.get_logger("rollart.generator")


def build_engines(run: RunSpec, hardware: str, *, dtype: str, on_gpu: bool) -> EngineSet:
    """The node's `run.generator.engines` engines of the configured backend, each on its slice of the node's
    GPUs (or cores); the backend (torch, vLLM) is imported only here, so a node without rollout never does."""
    spec = run.generator
    record = generation_backend(spec.backend)
    site = functools.partial(
        EngineSite, model_path=run.model.path, dtype=dtype, hardware=hardware, lora=run.trainer.lora, sim=run.sim
    )
    if record.simulated:  # one engine stands for the node's replicas (`run.sim.engines`)
        return EngineSet(record.build(spec, site(slots=[EngineSlot()])))
    gpus = _visible_gpus() if on_gpu else []
    gpu_slices = slices(gpus, spec.engines, what="visible GPUs") if on_gpu else [[]] * spec.engines
    if on_gpu and len(gpu_slices[0]) != spec.tensor_parallel_size:
        raise ConfigError(
            f"run.generator: {spec.engines} engines x tensor_parallel_size {spec.tensor_parallel_size} need "
            f"{spec.gpus_per_node()} GPUs; this node sees {len(gpus)} ({', '.join(gpus) or 'none'})"
        )
    given = os.environ.get(cpus.ENV)  # the launcher's share of the machine for this node (rollart.launch.placement)
    cores = cpus.parse_cpu_list(given) if given else []
    core_slices = slices(cores, spec.engines, what="CPU cores") if len(cores) >= spec.engines else [[]] * spec.engines

    def device(i: int) -> str:
        if spec.device != "auto":
            return spec.device
        return f"cuda:{i}" if on_gpu else "cpu"

    slots = [
        EngineSlot(gpus=gpu_slice, cores=core_slice, device=device(i))
        for i, (gpu_slice, core_slice) in enumerate(zip(gpu_slices, core_slices, strict=True))
    ]
    return EngineSet(record.build(spec, site(slots=slots)))


def _visible_gpus() -> list[str]:
    """The node's GPUs as CUDA numbers them for its processes: its `CUDA_VISIBLE_DEVICES` (set by the launcher
    or Slurm), else every GPU torch sees."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [gpu.strip() for gpu in given.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


SLOW_ENV = "ROLLART_SLOW_GENERATOR"
"""`NAME:SECONDS[,NAME:SECONDS...]`: the named generators wait that long before each generation, as a slower
engine would take longer: how the routing of a run is checked against a slow generator."""


def slowdown(value: str, node: str) -> float:
    """Seconds `node` is slowed by, from `ROLLART_SLOW_GENERATOR`'s value (0.0 when it is not named)."""
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, seconds = item.rpartition(":")
        try:
            delay = float(seconds)
        except ValueError:
            delay = -1.0
        if not sep or not name or delay < 0:
            raise ConfigError(f"{SLOW_ENV}: expected NAME:SECONDS[,NAME:SECONDS...] with SECONDS >= 0; got {item!r}")
        if name == node:
            return delay
    return 0.0


class GeneratorNode(NodeDaemon):
    role = Role.GENERATOR

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend = generation_backend(self.topology.run.generator.backend)
        """What the node's engines need and can do (`rollart.generation.registry`)."""
        self.engine: EngineSet | None = None
        self.ready = asyncio.Event()
        self.served = 0
        self.aborted = 0
        self.engine_start_s: float | None = None
        self._engine_started: float | None = None
        self.recent_busy = RecentBusy()
        """On the loop's clock (simulated time in the in-process simulations), as the routers time calls."""
        self._engine_failed = asyncio.Event()
        """Set when the engine can serve no more (`_engine_error` says why): the node then ends (`_serve_engine`)."""
        self._engine_error: EngineClosed | None = None
        self.receiver = WeightReceiver(
            self._load_weights,
            dtype=self._weights_dtype(),
            keep_base=self.topology.run.trainer.weights.delta,
            shared=self.backend.shared_weights,
        )
        self.receiver.relay_as(self.identity, self.secret, self.cfg, self.tls)  # relay chains pass through generators
        self.ucx_port = 0
        self.slowed_s = slowdown(os.environ.get(SLOW_ENV, ""), self.spec.name)
        """Seconds this node waits before each generation (`ROLLART_SLOW_GENERATOR`, for routing checks)."""
        if self.slowed_s:
            log.warning("generator.slowed", seconds=self.slowed_s, why=f"{SLOW_ENV} names this node")

    @property
    def on_gpu(self) -> bool:
        """Whether the engines run on GPUs: the node was given some (`resources.gpus`), or it runs vLLM where
        CUDA is (vLLM takes the GPU whatever the topology says)."""
        if self.spec.resources.gpus > 0:
            return True
        return self.backend.takes_visible_gpus and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))

    @functools.cached_property
    def dtype(self) -> str:
        """The dtype the engines run floating-point weights in (`run.generator.dtype`, auto resolved against the
        checkpoint and the device): what the weights must arrive in."""
        run = self.topology.run
        if not self.backend.pushed_weights:  # a modelled engine: no weights to cast
            return "float32"
        return engine_dtype(run.generator.dtype, run.model.path, on_gpu=self.on_gpu)

    def _weights_dtype(self) -> Any:
        from rollart.weights.buckets import wire_dtype

        return wire_dtype(self.dtype, what=f"generator {self.spec.name}")

    async def _load_weights(self, version: int, weights: dict[str, Any]) -> None:
        await self.ready.wait()
        assert self.engine is not None
        lora = self.topology.run.trainer.lora
        try:
            if lora is not None:
                await self.engine.load_adapter(version, weights, lora)  # the push holds the adapters only
            else:
                await self.engine.load_weights(version, weights)
        except EngineClosed as error:
            # An engine that can serve no more (a swap that failed half-way leaves its workers on two versions):
            # the node ends, and its launcher restarts it on the newest weights.
            self._engine_gone(error)
            raise
        log.info("generator.weights", version=version, lora=lora is not None)

    def _engine_gone(self, error: EngineClosed) -> None:
        """The engine serves no more (its process died, or a swap failed half-way): end the node (`_serve_engine`),
        whose launcher restarts it, rather than answer every request with the error."""
        self._engine_error = self._engine_error or error
        self._engine_failed.set()

    async def on_bulk(self, conn: Connection, peer: Identity) -> None:
        # Weights come from the trainer, or from a generator relaying them down a chain; the session
        # server has checked `peer` against the topology, so another role's node cannot push.
        if peer.role not in (Role.TRAINER.value, Role.GENERATOR.value):
            raise ProtocolError(f"{peer.node} ({peer.role}) may not push weights to {self.spec.name}")
        await self.receiver.on_bulk(conn, peer)

    async def work(self) -> None:
        run = self.topology.run
        if run.rollout is None:
            await super().work()
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.receiver.serve())
            transport = run.trainer.weights.transport
            # A simulated engine gets no real weights (`SimWeights` stands for the push).
            # UCX does not encrypt: with TLS, weights come over the session port's TLS. A group push (nccl)
            # comes over the session port and the group its push names.
            plain = transport in ("tcp", "nccl") or self.tls is not None
            if not plain and self.backend.pushed_weights and ucx_unavailable() is None:
                self.ucx_port = await self.receiver.listen_ucx(
                    local=self.identity, secret=self.secret, cfg=self.cfg, port=0
                )
            try:
                await self._serve_engine()
            finally:
                await self.receiver.close()

    async def _serve_engine(self) -> None:
        run = self.topology.run
        started = time.monotonic()
        engine = build_engines(run, self.spec.hardware, dtype=self.dtype, on_gpu=self.on_gpu)
        await engine.start()
        if self.backend.pins_after_start and (given := os.environ.get(cpus.ENV)):
            pinned = cpus.pin_tree(cpus.parse_cpu_list(given))  # started on every core: now its own
            log.info("generator.pinned", cpus=given, threads=pinned)
        self.engine = engine
        self._engine_started = time.monotonic()
        self.engine_start_s = round(self._engine_started - started, 3)
        self.ready.set()
        log.info(
            "generator.ready",
            backend=run.generator.backend,
            engines=len(engine.engines),
            dtype=self.dtype,
            gpu=self.on_gpu,
            start_s=self.engine_start_s,
        )
        try:
            await self._engine_failed.wait()
            assert self._engine_error is not None
            raise self._engine_error
        finally:
            await engine.close()

    async def on_role_request(self, session: Session, msg: Any) -> Any:
        match msg:
            case Generate():
                return await self._generate(msg)
            case WeightsWhere():
                return WeightsHere(self.receiver.version, self.ucx_port, self.dtype)
            case SimWeights():
                return await self._sim_weights(msg)
            case _:
                return await super().on_role_request(session, msg)

    async def _sim_weights(self, msg: SimWeights) -> SimWeights:
        """Simulation mode's weight push: the version arrives after `after_s`, then the engine stops
        generating for `pause_s` while it loads."""
        from rollart.generation.sim import SimEngine

        await self.ready.wait()
        engine = self.engine.engines[0] if self.engine is not None else None
        if not isinstance(engine, SimEngine):
            raise RemoteError("bad-request", f"{self.spec.name} runs no simulated engine")
        await engine.clock.sleep(msg.after_s)
        engine.pause(msg.pause_s)
        await engine.clock.sleep(msg.pause_s)
        await engine.load_weights(msg.version, {})
        return msg

    async def _generate(self, msg: Generate) -> Generated:
        await self.ready.wait()  # bounded by the request's own deadline
        if self.receiver.version < msg.min_version:
            await self.receiver.wait_version(msg.min_version, timeout=float("inf"))  # the deadline bounds it
        assert self.engine is not None
        params = msgspec.convert(msg, SamplingParams, from_attributes=True)  # its sampling fields, by name
        if self.slowed_s:
            await asyncio.sleep(self.slowed_s)  # as if its engine were that much slower (queued_s stays 0)
        try:
            result = await self.engine.generate(msg.request_id, msg.prompt_ids, params, key=msg.trajectory_id)
        except asyncio.CancelledError:
            self.aborted += 1  # the caller gave up: the engine has aborted the request
            raise
        except ValueError as exc:
            raise RemoteError("bad-request", str(exc)) from exc
        except EngineClosed as error:  # its engine died (vLLM's engine core): the node ends, to be restarted
            self._engine_gone(error)
            raise
        if result.finish_reason == "abort":
            self.aborted += 1
        self.served += 1
        load = self.engine.load()  # piggybacked for the env-hosts' routers: no poll needed
        return Generated(
            request_id=msg.request_id,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            versions=result.versions,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            generator=self.spec.name,
            queued_s=result.queued_s,
            running=load.running,
            waiting=load.waiting,
            busy=round(self.recent_busy.update(load.busy_fraction, asyncio.get_running_loop().time()), 4),
        )

    async def drain_work(self) -> None:
        busy: dict[str, float] = {}
        if self.engine is not None and self._engine_started is not None:
            up = time.monotonic() - self._engine_started
            load = self.engine.load()
            busy = {
                "engine_up_s": round(up, 3),
                "busy_s": round(load.busy_fraction * up, 3),
                "kv_reused_tokens": load.kv_reused_tokens,
            }
        log.info("generator.summary", served=self.served, aborted=self.aborted, **busy)

    def node_load(self) -> dict[str, float]:
        if self.engine is None or self._engine_started is None:
            return {}
        up = time.monotonic() - self._engine_started
        load = self.engine.load()
        return {
            "busy_s": load.busy_fraction * up,
            "engine_up_s": up,
            "version": float(self.receiver.version),
            "ucx_port": float(self.ucx_port),
            "apply_s": self.receiver.stats().last_apply_s,
        }

    def progress(self) -> str:
        if self.engine is None:
            return "engine starting" if self.topology.run.rollout is not None else ""
        return f"served {self.served}, busy {self.engine.load().busy_fraction:.0%}"

    def role_counters(self) -> dict[str, tuple[str, float]]:
        weights = self.receiver.stats()
        counters: dict[str, tuple[str, float]] = {
            "rollart_generator_requests_served": ("Generation requests answered", self.served),
            "rollart_generator_requests_aborted": ("Generation requests cancelled by their env-host", self.aborted),
            "rollart_generator_weight_versions_applied": ("Weight versions received and applied", weights.applied),
            "rollart_generator_weight_bytes_received": ("Weight bytes received", weights.bytes_received),
            "rollart_generator_weight_bytes_decoded": (
                "Weight bytes received, counting deltas as the whole buckets they make",
                weights.bytes_decoded,
            ),
            "rollart_generator_weight_deltas_applied": ("Weight versions applied that came as deltas", weights.deltas),
        }
        if self.engine is not None:
            load = self.engine.load()
            counters["rollart_generator_tokens_generated"] = ("Tokens generated", load.generated_tokens)
            counters["rollart_generator_kv_reused_tokens"] = (
                "Prompt tokens of decode halves whose KV cache came from the generator that prefilled them",
                load.kv_reused_tokens,
            )
        return counters

    def policy_version(self) -> int | None:
        return None if self.engine is None else self.engine.load().version

    def busy_fraction(self) -> float | None:
        """Time generating since the engine started."""
        return None if self.engine is None else self.engine.load().busy_fraction

    def queue_depths(self) -> dict[str, int]:
        if self.engine is None:
            return {}
        load = self.engine.load()
        return {"running": load.running, "waiting": load.waiting}

    def status(self) -> dict[str, Any]:
        status = super().status()
        engine: dict[str, Any] = {
            "ready": self.ready.is_set(),
            "served": self.served,
            "aborted": self.aborted,
            "lora": self.topology.run.trainer.lora is not None,  # versions are adapters on the base
        }
        if self.engine is not None:
            load = self.engine.load()
            engine |= {
                "backend": self.topology.run.generator.backend,
                "engines": len(self.engine.engines),
                "dtype": self.dtype,
                "start_s": self.engine_start_s,
                "busy_fraction": round(load.busy_fraction, 4),
                "generated_tokens": load.generated_tokens,
                "kv_reused_tokens": load.kv_reused_tokens,
                "version": load.version,
            }
        engine["weights"] = vars(self.receiver.stats()) | {"ucx_port": self.ucx_port}
        status["engine"] = engine
        return status
