"""The engines of one generator node (`run.generator.engines`): one GPU slice or share of cores each.

A generator node on a host of 8 GPUs with `tensor_parallel_size: 2` runs four engines; the node is one daemon
with one session port, and `EngineSet` spreads its requests over them. A trajectory stays on the engine that
served its first turn (its prompt's KV cache is there, to be reused by the next turn's prefix); a new one
goes to the engine with the fewest requests in flight. A weight version (or a LoRA adapter version) is loaded into
every engine.

`slices` cuts the node's devices (its `CUDA_VISIBLE_DEVICES`, or its CPU cores) into one part per engine.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from rollart.generation.engine import EngineLoad, GenerationEngine, GenerationResult, InvalidRequest, SamplingParams

if TYPE_CHECKING:
    import torch

    from rollart.lora.spec import LoraSpec

T = TypeVar("T")
_STICKY = 65536
"""Trajectories remembered for stickiness; the oldest are forgotten first (a finished one is never asked again)."""


def slices(items: Sequence[T], parts: int, *, what: str) -> list[list[T]]:
    """`items` cut into `parts` equal consecutive slices (the devices or cores of each engine)."""
    if parts < 1 or len(items) % parts:
        raise InvalidRequest(f"{len(items)} {what} cannot be split evenly into {parts} engines")
    size = len(items) // parts
    return [list(items[i * size : (i + 1) * size]) for i in range(parts)]


class EngineSet:
    """Several engines behind the one interface a generator node drives."""

    def __init__(self, engines: Sequence[GenerationEngine]) -> None:
        if not engines:
            raise InvalidRequest("an engine set needs at least one engine")
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)
        self._by_request: dict[str, int] = {}
        self._by_key: collections.OrderedDict[str, int] = collections.OrderedDict()

    async def start(self) -> None:
        """Start the engines one after the other: transformers' loading is not thread-safe (two models loaded at
        once in two threads fail with "Cannot copy out of meta tensor"), and vLLM starts one engine at a time
        anyway (each start edits the process environment its engine core copies)."""
        for engine in self.engines:
            await engine.start()

    def _pick(self, key: str | None) -> int:
        if key is not None and (index := self._by_key.get(key)) is not None:
            self._by_key.move_to_end(key)
            return index
        index = min(range(len(self.engines)), key=self._in_flight.__getitem__)
        if key is not None:
            self._by_key[key] = index
            if len(self._by_key) > _STICKY:
                self._by_key.popitem(last=False)
        return index

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, key: str | None = None
    ) -> GenerationResult:
        """Generate on the engine `key` (a trajectory id) used before, else on the least loaded one."""
        index = self._pick(key)
        self._in_flight[index] += 1
        self._by_request[request_id] = index
        try:
            return await self.engines[index].generate(request_id, prompt_ids, params)
        finally:
            self._in_flight[index] -= 1
            self._by_request.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        index = self._by_request.get(request_id)
        return index is not None and await self.engines[index].abort(request_id)

    async def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Load `version` into every engine (they only read the tensors)."""
        async with asyncio.TaskGroup() as tg:
            for engine in self.engines:
                tg.create_task(engine.load_weights(version, weights))

    async def load_adapter(self, version: int, adapters: Mapping[str, torch.Tensor], spec: LoraSpec) -> None:
        """Load LoRA adapter `version` into every engine (they only read the tensors)."""
        async with asyncio.TaskGroup() as tg:
            for engine in self.engines:
                tg.create_task(engine.load_adapter(version, adapters, spec))

    def load(self) -> EngineLoad:
        """All engines together: requests summed, busy averaged, the oldest version any of them holds."""
        loads = [engine.load() for engine in self.engines]
        return EngineLoad(
            running=sum(load.running for load in loads),
            waiting=sum(load.waiting for load in loads),
            busy_fraction=sum(load.busy_fraction for load in loads) / len(loads),
            generated_tokens=sum(load.generated_tokens for load in loads),
            version=min(load.version for load in loads),
            kv_reused_tokens=sum(load.kv_reused_tokens for load in loads),
        )

    async def close(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for engine in self.engines:
                tg.create_task(engine.close())
