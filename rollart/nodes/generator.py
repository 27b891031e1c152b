"""The generator node: an inference engine of one hardware class, serving generation requests.

Env-hosts send `Generate` requests; the engine batches every request in flight (transformers,
vLLM, or in simulation mode a `SimEngine`: `run.generator.backend`). A request whose caller gives up (timeout, a
redundant trajectory cancelled, a stale trajectory aborted) is cancelled here too, which aborts
it in the engine; the aborts are counted in `/status`.

Weights arrive from the trainer on bulk connections (TCP to the session port, or UCX to the
port `WeightsHere` names) into a `WeightReceiver`, which hands each complete version to the
engine's `load_weights`: requests in flight keep going and finish under the new version. A
request whose `min_version` is newer than the weights held waits for the push.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from typing import Any

import msgspec
import structlog

from rollart import cpus
from rollart.engines.base import GenerationEngine, SamplingParams
from rollart.errors import ConfigError
from rollart.nodes.base import NodeDaemon
from rollart.protocol import Connection, Identity, Session
from rollart.protocol.errors import RemoteError
from rollart.protocol.messages import Generate, Generated, SimWeights, WeightsHere, WeightsWhere
from rollart.topology import Role, RunSpec
from rollart.weights import WeightReceiver, ucx_unavailable

log = structlog.get_logger("rollart.generator")


def build_engine(run: RunSpec, hardware: str) -> GenerationEngine:
    """The configured backend for a generator of `hardware`; imported here so a node without rollout
    never imports torch."""
    backend, model_path = run.generator.backend, run.model.path
    max_batch_size, dtype = run.generator.max_batch_size, run.generator.dtype
    if backend == "sim":
        from rollart.sim.engine import build_sim_engine

        return build_sim_engine(run.sim, hardware, tokenizer_path=model_path, max_batch_size=max_batch_size)
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "run.generator.backend: vllm is not installed in this environment; run bin/setup-vllm and start "
                "the nodes with .venv-vllm/bin/python (docs/vllm.md), or use backend: hf"
            )
        from rollart.engines.vllm_engine import VLLMEngine

        # the launcher's share of the machine for this node (rollart.launch.placement), if any
        bind = os.environ.get(cpus.ENV) or None
        return VLLMEngine(model_path, max_batch_size=max_batch_size, dtype=dtype, cpu_threads_bind=bind)
    import torch

    from rollart.engines.hf import HFEngine

    return HFEngine(model_path, max_batch_size=max_batch_size, dtype=getattr(torch, dtype))


class GeneratorNode(NodeDaemon):
    role = Role.GENERATOR

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: GenerationEngine | None = None
        self.ready = asyncio.Event()
        self.served = 0
        self.aborted = 0
        self.engine_start_s: float | None = None
        self._engine_started: float | None = None
        self.receiver = WeightReceiver(
            self._load_weights, dtype=self._weights_dtype(), keep_base=self.topology.run.trainer.weight_delta
        )
        self.receiver.relay_as(self.identity, self.secret, self.cfg)  # relay chains pass through generators
        self.ucx_port = 0

    def _weights_dtype(self) -> Any:
        """The dtype the engine runs floating-point weights in: what they must arrive in."""
        from rollart.weights.buckets import wire_dtype

        return wire_dtype(self.topology.run.generator.dtype, what=f"generator {self.spec.name}")

    async def _load_weights(self, version: int, weights: dict[str, Any]) -> None:
        await self.ready.wait()
        assert self.engine is not None
        await self.engine.load_weights(version, weights)
        log.info("generator.weights", version=version)

    async def on_bulk(self, conn: Connection, peer: Identity) -> None:
        await self.receiver.on_bulk(conn, peer)

    async def work(self) -> None:
        run = self.topology.run
        if run.rollout is None:
            await super().work()
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.receiver.serve())
            transport = run.trainer.weight_transport
            # A simulated engine gets no real weights (`SimWeights` stands for the push).
            if transport != "tcp" and run.generator.backend != "sim" and ucx_unavailable() is None:
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
        engine = build_engine(run, self.spec.hardware)
        await engine.start()
        if run.generator.backend == "vllm" and (given := os.environ.get(cpus.ENV)):
            pinned = cpus.pin_tree(cpus.parse_cpu_list(given))  # started on every core: now its own
            log.info("generator.pinned", cpus=given, threads=pinned)
        self.engine = engine
        self._engine_started = time.monotonic()
        self.engine_start_s = round(self._engine_started - started, 3)
        self.ready.set()
        log.info("generator.ready", backend=run.generator.backend, start_s=self.engine_start_s)
        try:
            await asyncio.Event().wait()
        finally:
            await engine.close()

    async def on_role_request(self, session: Session, msg: Any) -> Any:
        match msg:
            case Generate():
                return await self._generate(msg)
            case WeightsWhere():
                return WeightsHere(self.receiver.version, self.ucx_port, self.topology.run.generator.dtype)
            case SimWeights():
                return await self._sim_weights(msg)
            case _:
                return await super().on_role_request(session, msg)

    async def _sim_weights(self, msg: SimWeights) -> SimWeights:
        """Simulation mode's weight push: the version arrives after `after_s`, then the engine stops
        generating for `pause_s` while it loads."""
        from rollart.sim.engine import SimEngine

        await self.ready.wait()
        if not isinstance(self.engine, SimEngine):
            raise RemoteError("bad-request", f"{self.spec.name} runs no simulated engine")
        await self.engine.clock.sleep(msg.after_s)
        self.engine.pause(msg.pause_s)
        await self.engine.clock.sleep(msg.pause_s)
        await self.engine.load_weights(msg.version, {})
        return msg

    async def _generate(self, msg: Generate) -> Generated:
        await self.ready.wait()  # bounded by the request's own deadline
        if self.receiver.version < msg.min_version:
            await self.receiver.wait_version(msg.min_version, timeout=float("inf"))  # the deadline bounds it
        assert self.engine is not None
        params = msgspec.convert(msg, SamplingParams, from_attributes=True)  # its sampling fields, by name
        try:
            result = await self.engine.generate(msg.request_id, msg.prompt_ids, params)
        except asyncio.CancelledError:
            self.aborted += 1  # the caller gave up: the engine has aborted the request
            raise
        except ValueError as exc:
            raise RemoteError("bad-request", str(exc)) from exc
        if result.finish_reason == "abort":
            self.aborted += 1
        self.served += 1
        return Generated(
            request_id=msg.request_id,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            versions=result.versions,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            generator=self.spec.name,
        )

    async def drain_work(self) -> None:
        busy: dict[str, float] = {}
        if self.engine is not None and self._engine_started is not None:
            up = time.monotonic() - self._engine_started
            busy = {"engine_up_s": round(up, 3), "busy_s": round(self.engine.load().busy_fraction * up, 3)}
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
            counters["rollart_generator_tokens_generated"] = ("Tokens generated", self.engine.load().generated_tokens)
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
        engine: dict[str, Any] = {"ready": self.ready.is_set(), "served": self.served, "aborted": self.aborted}
        if self.engine is not None:
            load = self.engine.load()
            engine |= {
                "backend": self.topology.run.generator.backend,
                "start_s": self.engine_start_s,
                "busy_fraction": round(load.busy_fraction, 4),
                "generated_tokens": load.generated_tokens,
                "version": load.version,
            }
        engine["weights"] = vars(self.receiver.stats()) | {"ucx_port": self.ucx_port}
        status["engine"] = engine
        return status
