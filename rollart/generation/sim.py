"""The simulated generation engine: the `GenerationEngine` interface, timed by a hardware model.

It schedules like a continuous-batching server (vLLM without chunked prefill; prefix caching with
`prefix_cache`, below):
requests queue in arrival order; one is admitted when the batch has room (`max_batch_size`) and
the KV cache can hold its prompt plus its whole response (otherwise it waits: "queueing when KV is
full"); the newly admitted prompts are prefilled together, which pauses decoding; then every
running request gains one token per decode step. Each prefill and decode step lasts what
`CostModel` says (`rollart/sim/hardware.py`), on the `SimClock`.

`replicas` copies of the engine (data parallel, each on its own GPUs) share one queue; a replica
admits up to its share of the work, so their batches stay level.

To keep the event loop's work per simulated second small, decode steps run in runs of up to
`max_steps_per_wake` at a time, cut short at the next request to finish; a request that arrives
meanwhile waits for the end of the run (at most that many steps, a few tens of milliseconds of
simulated time). The engine keeps its own timeline (`sleep_until`), so loop overhead does not add up.

Prefix caching (`prefix_cache`, as vLLM's automatic prefix caching): each replica remembers the blocks of
`PREFIX_BLOCK` tokens whose KV cache it computed or received (prompts once prefilled, prompt and reply once a
request ends), keyed by a hash of the block and every block before it, least recently used out first beyond
its KV-cache size in blocks (a simplification: vLLM keeps cached blocks only while free blocks last). A newly
admitted prompt prefills only what follows its longest run of leading blocks the replica holds (at least its
last token). Replicas stand for separate engines behind a router that keeps a trajectory where its prefix is
cached, as the LLMProxy does with generators: an arriving request whose longest cached prefix a replica last
cached (a trajectory's previous turn, a group's shared prompt) waits in that replica's own queue, unless that
replica has `STICKY_SLACK` (or a tenth) more requests than the least loaded one; the rest share one queue. A
replica with room takes its own queue's oldest, else the shared queue's oldest, and, when it runs nothing,
the oldest of another replica's queue. The KV cache reserved per request is unchanged (shared blocks are not
counted once).

Disaggregated serving (`rollout.routing: disaggregated`, as vLLM's disaggregated prefill): a request with
`prefill_only` is prefilled, then holds its KV cache while it leaves on its replica's link, and ends with
no tokens; one with `kv_from` first receives its prompt's KV cache on one of the engine's links, then
queues and is decoded without a prefill. Each replica has one link of `kv_link_gbps`; a transfer takes
tokens x KV bytes per token over it, at the sender and then again at the receiver: one after the other, an
overestimate (a real transfer holds both links at once). Which tokens: without the prefix cache, the whole
prompt at both ends. With it, only what the decoding replica lacks crosses, as vLLM's KV connectors load
only past the local prefix-cache hit: the receiver takes the blocks the replica it queues on (the holder of
the prompt's longest cached prefix, when it sticks; else the first link to come free, and the whole prompt)
does not hold, and the sender counts what it prefilled. For a trajectory whose turns are prefilled on one
replica and decoded on another, each holding its history, both are about the turn's new tokens; where the
receiver lacks more (a new decoding replica), it takes the rest, so a transfer never takes less than the
receiver's share of it.

Tokens are drawn uniformly from `token_ids` (ids the tokenizer can decode), so `logprobs` are
log(1 / len(token_ids)): what the sampler did. A response is `max_tokens` long, or, with
`length_min_frac < 1`, a length drawn uniformly between that fraction of `max_tokens` and all of
it (ending with `eos_id`, finish "stop"), from the request's seed when it has one. Weights are
not used: `load_weights` only changes the version later tokens report.

One piece: admission, the prefix cache, the KV links and the decode runs act on the same queues, replicas
and timeline in each scheduling step.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart.clock import SimClock
from rollart.generation.engine import (
    EngineClosed,
    EngineLoad,
    FinishReason,
    GenerationResult,
    InvalidRequest,
    SamplingParams,
)
from rollart.sim.config import SimSpec
from rollart.sim.hardware import CostModel

if TYPE_CHECKING:
    from rollart.lora.spec import LoraSpec

PREFIX_BLOCK = 16
"""Tokens per prefix-cache block (vLLM's default block size on GPU)."""
STICKY_SLACK = 2
"""Prefix cache: requests more than the least loaded replica's that a replica may hold and still queue a request whose
prefix it caches (or a tenth of that replica's load, if more), as `rollart.rollout.routing.by_class.STICKY_SLACK`."""


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_tokens: int
    target: int
    """Tokens this request will generate."""
    stop: bool
    """Whether it ends with EOS (before max_tokens) rather than by length."""
    rng: random.Random
    done: asyncio.Future[GenerationResult]
    arrived_s: float = 0.0
    """Simulated time it reached the engine."""
    queued_s: float = 0.0
    """Simulated seconds it waited before a replica admitted it."""
    generated: int = 0
    """Tokens decoded so far; the ids themselves are drawn when the request ends."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(policy version, tokens decoded under it), in order."""
    prefilled: bool = False
    """Its prompt's KV cache came from the engine that prefilled it: no prefill here."""
    prompt_ids: list[int] = field(default_factory=list)
    """With the prefix cache only: the prompt, whose blocks and the reply's are cached when it ends."""
    blocks: list[int] = field(default_factory=list)
    """With the prefix cache only: the chained hashes of the prompt's whole blocks."""
    cached: int = 0
    """Prompt tokens found in the prefix cache at admission (not prefilled)."""
    holder: int | None = None
    """Prefix cache: the replica whose own queue it waits in (None: the shared queue)."""

    @property
    def kv_tokens(self) -> int:
        """KV cache reserved at admission: the prompt and the whole response."""
        return self.prompt_tokens + self.target

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(eq=False)
class _Replica:
    """One copy of the model on its own GPUs: its batch, its KV cache, its timeline."""

    index: int
    running: dict[str, _Request] = field(default_factory=dict)
    kv_used: int = 0
    timeline: float = 0.0
    """Simulated time at which this replica's current work ends."""
    busy_s: float = 0.0
    sending: dict[str, _Request] = field(default_factory=dict)
    """Prefill halves whose KV cache is leaving on the replica's link (holding their KV cache, not decoded)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to wake the replica while it is idle (nothing running, nothing it could take)."""
    idle: bool = False
    cache: collections.OrderedDict[int, None] = field(default_factory=collections.OrderedDict)
    """Prefix cache: block hashes, least recently used first."""


class SimEngine:
    """A generation engine of one hardware shape (`replicas` copies of it), in simulated time."""

    def __init__(
        self,
        cost: CostModel,
        *,
        clock: SimClock,
        token_ids: list[int],
        eos_id: int,
        max_batch_size: int = 256,
        replicas: int = 1,
        length_min_frac: float = 1.0,
        max_steps_per_wake: int = 8,
        kv_link_gbps: float = 200.0,
        prefix_cache: bool = False,
        seed: int = 0,
    ) -> None:
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if not 0.0 < length_min_frac <= 1.0:
            raise ValueError(f"length_min_frac must be in (0, 1], got {length_min_frac}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.cost = cost
        self.clock = clock
        self.token_ids = token_ids
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size
        self.length_min_frac = length_min_frac
        self.max_steps_per_wake = max_steps_per_wake
        self.kv_link_gbps = kv_link_gbps
        self.prefix_cache = prefix_cache
        self._cache_blocks = cost.kv_capacity_tokens // PREFIX_BLOCK
        self._holders: dict[int, int] = {}
        """Prefix cache: block hash -> the replica that cached it last."""
        self._own_queues: list[collections.deque[_Request]] = [collections.deque() for _ in range(replicas)]
        """Prefix cache: each replica's waiting requests, whose longest cached prefix it holds."""
        self.cached_tokens = 0
        """Prompt tokens found in a replica's prefix cache, not prefilled."""
        self._links = [0.0] * replicas
        """When each replica's KV link is free (simulated time)."""
        self._sends: set[asyncio.Task[None]] = set()
        self.version = 0
        self._rng = random.Random(seed)
        self._logprob = -math.log(len(token_ids))
        self._waiting: collections.deque[_Request] = collections.deque()
        self._replicas = [_Replica(i) for i in range(replicas)]
        self._running = 0
        self._schedulers_ended = False
        """Requests running on all replicas (kept as a count: replicas read it on every admission)."""
        self._schedulers: list[asyncio.Task[None]] = []
        self._started_at = 0.0
        self.prefill_s = 0.0
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.kv_received_tokens = 0
        """Prompt tokens whose KV cache arrived from another engine (`kv_from`)."""

    @property
    def busy_s(self) -> float:
        """Simulated seconds spent prefilling or decoding, summed over replicas."""
        return sum(r.busy_s for r in self._replicas)

    async def start(self) -> None:
        self._started_at = self.clock.now()
        self._schedulers_ended = False
        for replica in self._replicas:
            replica.timeline = self._started_at
            task = asyncio.create_task(self._schedule(replica), name=f"sim-replica-{replica.index}")
            task.add_done_callback(self._scheduler_ended)
            self._schedulers.append(task)

    def _scheduler_ended(self, task: asyncio.Task[None]) -> None:
        """A replica's scheduler died (a bug): every request waiting on the engine fails, none hangs."""
        self._schedulers_ended = True
        if task.cancelled() or task.exception() is None:
            return
        error = EngineClosed(f"a simulated engine replica died: {task.exception()!r}")
        running = self._held()
        for request in [*self._queued(), *running]:
            if not request.done.done():
                request.done.set_exception(error)

    def _held(self) -> list[_Request]:
        """Every request a replica holds: running, or sending its KV cache on."""
        return [request for r in self._replicas for request in [*r.running.values(), *r.sending.values()]]

    async def close(self) -> None:
        for task in [*self._schedulers, *self._sends]:
            task.cancel()
        await asyncio.gather(*self._schedulers, *self._sends, return_exceptions=True)
        self._schedulers = []
        running = self._held()
        for request in [*self._queued(), *running]:
            if not request.done.done():
                request.done.set_exception(EngineClosed("the simulated engine closed"))

    def _waiting_n(self) -> int:
        """How many requests wait: in the shared queue and the replicas' own."""
        return len(self._waiting) + sum(len(own) for own in self._own_queues)

    def _queued(self) -> list[_Request]:
        """Every waiting request: the shared queue, then the replicas' own."""
        return [*self._waiting, *(request for own in self._own_queues for request in own)]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not self._schedulers or self._schedulers_ended:
            raise EngineClosed("the simulated engine is not running")
        if params.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {params.max_tokens}")
        if params.prefill_only and params.kv_from is not None:
            raise InvalidRequest("a request is either the prefill half (prefill_only) or the decode half (kv_from)")
        rng = random.Random(params.seed) if params.seed is not None else random.Random(self._rng.random())
        target = params.max_tokens
        if self.length_min_frac < 1.0:
            target = rng.randint(max(1, math.ceil(self.length_min_frac * params.max_tokens)), params.max_tokens)
        if params.prefill_only:
            target = 0
        request = _Request(
            request_id,
            len(prompt_ids),
            target,
            stop=target < params.max_tokens,
            rng=rng,
            done=asyncio.get_running_loop().create_future(),
            arrived_s=self.clock.now(),
            prefilled=params.kv_from is not None,
        )
        if self.prefix_cache:
            request.prompt_ids, request.blocks = prompt_ids, _block_hashes(prompt_ids)
        if request.kv_tokens > self.cost.kv_capacity_tokens:
            raise InvalidRequest(
                f"request {request_id} needs {request.kv_tokens} tokens of KV cache; the engine holds "
                f"{self.cost.kv_capacity_tokens}"
            )
        holder = self._holder(request.blocks) if self.prefix_cache else None
        if holder is not None and not self._sticks(holder):
            holder = None
        if request.prefilled:
            # what the replica that will decode it holds already does not cross (vLLM's KV connectors load only
            # past the local prefix-cache hit): a trajectory's next turn brings its new tokens only
            held = self._lookup(self._replicas[holder], request) if holder is not None else 0
            await self._receive_kv(request.prompt_tokens - held, link=holder)
            request.arrived_s = self.clock.now()
        if holder is not None:
            request.holder = holder
            self._own_queues[holder].append(request)
        else:
            self._waiting.append(request)
        self._wake_one(request)
        try:
            return await asyncio.shield(request.done)
        except asyncio.CancelledError:
            await self.abort(request_id)
            raise

    def _transfer(self, link: int, tokens: int) -> float:
        """Book `tokens` tokens of KV cache on replica `link`'s link, after what it carries already: when it ends."""
        seconds = tokens * self.cost.model.kv_bytes_per_token * 8 / (self.kv_link_gbps * 1e9)
        self._links[link] = max(self._links[link], self.clock.now()) + seconds
        return self._links[link]

    async def _receive_kv(self, tokens: int, *, link: int | None) -> None:
        """Wait while `tokens` tokens of KV cache arrive on replica `link`'s link (None: the first of the replicas'
        links to come free)."""
        if link is None:
            link = min(range(len(self._links)), key=self._links.__getitem__)
        self.kv_received_tokens += tokens
        await self.clock.sleep_until(self._transfer(link, tokens))

    async def _send_kv(self, replica: _Replica, request: _Request) -> None:
        """A prefill half's KV cache leaves on its replica's link (what it prefilled: the rest was cached, and the
        replica that decodes the trajectory holds it too when it decoded the turn before); then its KV cache is
        free and it is answered."""
        await self.clock.sleep_until(self._transfer(replica.index, request.prompt_tokens - request.cached))
        if replica.sending.pop(request.request_id, None) is not None:  # not aborted meanwhile
            replica.kv_used -= request.kv_tokens
            self._finish(request, "length")
            if replica.idle:
                replica.wake.set()  # room in its KV cache

    async def abort(self, request_id: str) -> bool:
        for queue in (self._waiting, *self._own_queues):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "abort")
                    return True
        for replica in self._replicas:
            if (sending := replica.sending.pop(request_id, None)) is not None:
                replica.kv_used -= sending.kv_tokens
                self._finish(sending, "abort")
                return True
            running = replica.running.get(request_id)
            if running is not None:
                self._retire(replica, running, "abort")
                self._wake_one()  # room for a waiting request
                return True
        return False

    async def load_weights(self, version: int, weights: Mapping[str, Any]) -> None:
        self.version = version

    async def load_adapter(self, version: int, adapters: Mapping[str, Any], spec: LoraSpec) -> None:
        """LoRA adapters, like weights, only change the version later tokens report (simulation mode's pushes
        are `SimWeights`, so a run under `run.trainer.lora` never calls this)."""
        self.version = version

    def pause(self, seconds: float) -> None:
        """Stop generating for `seconds` of simulated time (loading weights): every replica's next
        step starts that much later; requests in flight wait."""
        now = self.clock.now()
        for replica in self._replicas:
            replica.timeline = max(replica.timeline, now) + seconds

    def load(self) -> EngineLoad:
        now = max(self.clock.now(), *(r.timeline for r in self._replicas))
        capacity = (now - self._started_at) * len(self._replicas)
        return EngineLoad(
            running=sum(len(r.running) for r in self._replicas),
            waiting=self._waiting_n(),
            busy_fraction=min(1.0, self.busy_s / capacity) if capacity > 0 else 0.0,
            generated_tokens=self.generated_tokens,
            version=self.version,
            kv_reused_tokens=self.kv_received_tokens,
        )

    def _unrun(self, replica: _Replica, request: _Request) -> None:
        """Take a running request out of `replica`'s batch (its KV cache stays reserved)."""
        del replica.running[request.request_id]
        self._running -= 1

    def _retire(self, replica: _Replica, request: _Request, reason: FinishReason) -> None:
        """Take a running request off `replica`, free its KV cache, and answer it."""
        self._unrun(replica, request)
        replica.kv_used -= request.kv_tokens
        self._finish(request, reason)
        if self.prefix_cache and not request.done.cancelled() and request.done.exception() is None:
            reply = request.done.result().token_ids  # its KV cache stays, for the trajectory's next turn
            previous = request.blocks[-1] if request.blocks else 0
            self._remember(replica, _block_hashes(request.prompt_ids + reply, len(request.blocks), previous))

    def _finish(self, request: _Request, reason: FinishReason) -> None:
        if request.done.done():
            return
        tokens = request.rng.choices(self.token_ids, k=request.generated)
        if reason == "stop" and tokens:
            tokens[-1] = self.eos_id
        request.done.set_result(
            GenerationResult(
                token_ids=tokens,
                logprobs=[self._logprob] * len(tokens),
                versions=[version for version, count in request.versions for _ in range(count)],
                finish_reason=reason,
                prompt_tokens=request.prompt_tokens,
                queued_s=request.queued_s / self.clock.speedup,  # in the loop's seconds, as callers time calls
            )
        )

    def _wake_one(self, arrived: _Request | None = None) -> None:
        """A request arrived (or room freed up): wake one idle replica to look at the queue, if any
        is idle (the arrival's holder first); busy ones look on their own after each step. Waking all of
        them for every arrival made each arrival cost O(replicas) wake-ups."""
        first = [self._replicas[arrived.holder]] if arrived is not None and arrived.holder is not None else []
        for replica in [*first, *self._replicas]:
            if replica.idle and not replica.wake.is_set() and self._fits(replica):
                replica.wake.set()
                return

    def _fits(self, replica: _Replica) -> bool:
        """Whether a request waits that `replica` has the KV cache to take (`_candidate`)."""
        return self._candidate(replica) is not None

    def _candidate(self, replica: _Replica) -> _Request | None:
        """What `replica` takes next if it fits in its KV cache: the oldest of its own queue (prefix cache), else
        the oldest of the shared queue, else, when it runs nothing, the oldest of another replica's queue."""
        own = self._own_queues[replica.index]
        heads = [queue[0] for queue in (own, self._waiting) if queue]
        if not replica.running and not heads:
            heads = sorted((queue[0] for queue in self._own_queues if queue), key=lambda request: request.arrived_s)
        return next((request for request in heads[:2] if self._room(replica, request)), None)

    def _sticks(self, holder: int) -> bool:
        """Whether replica `holder` is not so much busier than the least loaded that a request should wait for it."""
        loads = [len(replica.running) + len(own) for replica, own in zip(self._replicas, self._own_queues, strict=True)]
        return loads[holder] <= min(loads) + max(STICKY_SLACK, loads[holder] // 10)

    def _room(self, replica: _Replica, request: _Request) -> bool:
        return replica.kv_used + request.kv_tokens <= self.cost.kv_capacity_tokens

    def _next(self, replica: _Replica) -> _Request | None:
        """Take `_candidate` off the queues (None: nothing fits)."""
        request = self._candidate(replica)
        if request is None:
            return None
        queue = self._waiting if request.holder is None else self._own_queues[request.holder]
        assert queue[0] is request  # a candidate is a queue's oldest
        queue.popleft()
        return request

    def _holder(self, blocks: list[int]) -> int | None:
        """The replica that last cached the longest prefix of these blocks (looked up from the last block back:
        a turn's new blocks come after its history)."""
        for block in reversed(blocks):
            if (holder := self._holders.get(block)) is not None:
                return holder
        return None

    def _admit(self, replica: _Replica) -> list[_Request]:
        """Move waiting requests into this replica's batch (`_next`) while the batch and the KV cache have
        room, up to its share: the replicas' running counts are kept level."""
        total = self._waiting_n() + self._running
        share = max(1, -(-total // len(self._replicas)))
        admitted = []
        while len(replica.running) < min(self.max_batch_size, share) and (request := self._next(replica)):
            request.queued_s = max(0.0, replica.timeline - request.arrived_s)  # its prefill starts at the replica's
            replica.running[request.request_id] = request
            replica.kv_used += request.kv_tokens
            self._running += 1
            admitted.append(request)
            if request.prefilled:  # its KV cache arrived whole
                self._remember(replica, request.blocks)
            elif self.prefix_cache:
                request.cached = self._lookup(replica, request)
        return admitted

    def _lookup(self, replica: _Replica, request: _Request) -> int:
        """Prompt tokens of `request` whose KV cache `replica` holds: its leading cached blocks, short of the
        prompt's last token (whose logits the first decode step needs)."""
        hits = 0
        for block in request.blocks:
            if block not in replica.cache:
                break
            replica.cache.move_to_end(block)
            hits += 1
        return min(hits * PREFIX_BLOCK, request.prompt_tokens - 1)

    def _remember(self, replica: _Replica, blocks: list[int]) -> None:
        """`blocks` are in `replica`'s KV cache now: most recently used, the least recently used ones out."""
        cache = replica.cache
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
            self._holders[block] = replica.index
        while len(cache) > self._cache_blocks:
            block, _ = cache.popitem(last=False)
            if self._holders.get(block) == replica.index:
                del self._holders[block]

    async def _work(self, replica: _Replica, seconds: float) -> None:
        """Spend `seconds` of simulated time busy, on the replica's own timeline."""
        replica.timeline = max(replica.timeline, self.clock.now()) + seconds
        replica.busy_s += seconds
        await self.clock.sleep_until(replica.timeline)

    async def _schedule(self, replica: _Replica) -> None:
        while True:
            if not replica.running and not self._fits(replica):
                replica.idle = True
                replica.wake.clear()
                await replica.wake.wait()
                replica.idle = False
                replica.timeline = max(replica.timeline, self.clock.now())
            admitted = self._admit(replica)
            if tokens := sum(r.prompt_tokens - r.cached for r in admitted if not r.prefilled):
                seconds = self.cost.prefill_s(tokens)
                self.prefill_s += seconds
                self.prefilled_tokens += tokens
                self.cached_tokens += sum(r.cached for r in admitted)
                await self._work(replica, seconds)
                for request in admitted:
                    self._remember(replica, request.blocks)
            for request in admitted:
                if request.target == 0 and request.request_id in replica.running:  # prefill_only: sent on
                    self._unrun(replica, request)
                    replica.sending[request.request_id] = request
                    self._sends.add(send := asyncio.create_task(self._send_kv(replica, request)))
                    send.add_done_callback(self._sends.discard)
            if not replica.running:
                # Nothing to decode: what it admitted was aborted during the prefill, or another
                # replica took the work; look again after the others run.
                await asyncio.sleep(0)
                continue
            await self._decode(replica)

    async def _decode(self, replica: _Replica) -> None:
        """Decode steps for the replica's batch, up to the next request to finish."""
        left = min(r.target - r.generated for r in replica.running.values())
        steps = max(1, min(self.max_steps_per_wake, left))
        batch = list(replica.running.values())
        context = sum(r.context for r in batch)
        seconds = sum(self.cost.decode_step_s(len(batch), context + i * len(batch)) for i in range(steps))
        await self._work(replica, seconds)
        for request in batch:
            if request.request_id not in replica.running:  # aborted during the steps
                continue
            request.generated += steps  # steps never pass any request's target
            if request.versions and request.versions[-1][0] == self.version:
                request.versions[-1] = (self.version, request.versions[-1][1] + steps)
            else:
                request.versions.append((self.version, steps))
            self.generated_tokens += steps
            if request.generated >= request.target:
                self._retire(replica, request, "stop" if request.stop else "length")


def build_sim_engine(spec: SimSpec, hardware: str, *, tokenizer_path: str, max_batch_size: int) -> SimEngine:
    """The engine `spec` gives a generator of `hardware`, emitting the run tokenizer's ordinary tokens."""
    token_ids, eos_id = _vocabulary(tokenizer_path)
    return SimEngine(
        CostModel.build(spec.engines[hardware], spec.model),
        clock=SimClock(spec.speedup),
        token_ids=list(token_ids),
        eos_id=eos_id,
        max_batch_size=max_batch_size,
        replicas=spec.engines[hardware].replicas,
        length_min_frac=spec.response_length_min_frac,
        max_steps_per_wake=spec.max_steps_per_wake,
        kv_link_gbps=spec.kv_link_gbps,
        prefix_cache=spec.prefix_cache,
    )


@functools.cache  # one per process: the in-process simulation runs many generators
def _vocabulary(tokenizer_path: str) -> tuple[tuple[int, ...], int]:
    """The tokenizer's ordinary (not special) token ids, and its EOS id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    special = set(tokenizer.all_special_ids)
    return tuple(i for i in range(len(tokenizer)) if i not in special), tokenizer.eos_token_id


def _block_hashes(token_ids: list[int], start: int = 0, previous: int = 0) -> list[int]:
    """Chained hashes of the whole `PREFIX_BLOCK`-token blocks of `token_ids` from block `start` on (`previous`:
    the hash of the block before it): a block's hash stands for it and every block before it."""
    hashes = []
    for at in range(start * PREFIX_BLOCK, len(token_ids) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        previous = hash((previous, *token_ids[at : at + PREFIX_BLOCK]))
        hashes.append(previous)
    return hashes
