"""The KV store's side outside vLLM: which key each half of a disaggregated turn uses, and the removal of what was
read, abandoned or left behind (`rollart.generation.vllm.kv_connector` is the connector inside vLLM that writes
and reads it).

- The prefill half writes under the key of its own request id, the decode half reads the key of the request its
  `kv_from` ("<generator>/<request id>") names (`KVStore.handoff`);
- the decode half's engine claims the folder before reading it (`READING`) and removes it inside vLLM, after the read or
  when the request ends unread (`rollart.generation.vllm.kv_connector`: only there is it known whether a read is under
  way); a prefill half that ended without writing for good (aborted: vLLM may still write it after the abort) is removed
  then, and again at close;
- what a turn given up between its halves left is removed at close by the engine that wrote it (unless claimed),
  and by age by every engine: at start and every `SWEEP_EVERY_S`.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import time
from pathlib import Path

from rollart.generation.engine import SamplingParams

KV_ARG = "rollart_kv"
"""The sampling argument (vLLM's `extra_args`) that asks the connector to write a request's prompt KV under a key,
`("store", key)`, or to read it, `("load", key)`."""
READING = ".reading"
"""A decode half's engine renames the folder it is about to read to its key plus this, atomically: a folder is then
either there to read whole, or gone (and prefilled again by the decoder), never removed in the middle of a read."""
MAX_AGE_S = 600.0
"""A prefilled prompt's KV still in the store this long was abandoned (its decode half comes seconds later)."""
SWEEP_EVERY_S = 60.0

Handoff = tuple[str, str]
"""("store" | "load", key)."""


def kv_key(prefill_request_id: str) -> str:
    """The store's folder name for the prefill half `prefill_request_id` (a request id may hold any character)."""
    return hashlib.sha256(prefill_request_id.encode()).hexdigest()[:32]


def sweep(folder: Path, max_age_s: float = MAX_AGE_S) -> int:
    """Create `folder`, and remove what is in it older than `max_age_s`; returns how many were removed."""
    folder.mkdir(parents=True, exist_ok=True)
    cutoff = time.time() - max_age_s
    removed = 0
    for entry in folder.iterdir():  # a claimed one's age counts from its claim (`READING`)
        with contextlib.suppress(FileNotFoundError):  # another engine's sweep, or its decode half, took it
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return removed


class KVStore:
    """One engine's use of the store `folder` (shared with the other generators' engines)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._written: dict[str, float] = {}
        """Keys this engine's prefill halves wrote (or may still write), and when: removed at close."""
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await asyncio.to_thread(sweep, self.folder)
        self._sweeper = asyncio.create_task(self._sweep_every())

    @staticmethod
    def handoff(request_id: str, params: SamplingParams) -> Handoff | None:
        """What a request asks of the store (`KV_ARG`'s value); None: it is no half of a disaggregated turn."""
        if params.prefill_only:
            return ("store", kv_key(request_id))
        if params.kv_from is not None:
            return ("load", kv_key(params.kv_from.split("/", 1)[-1]))
        return None

    async def ended(self, handoff: Handoff, finish: str | None) -> None:
        """A request with `handoff` left the engine with vLLM's `finish` reason (None: cut short): remove what a
        prefill half cut short may have written. A decode half's folder is its engine's connector's to remove: the
        read may still be under way in vLLM's worker when the request is cut short here."""
        action, key = handoff
        if action == "load":
            return
        self._written[key] = time.time()
        if finish not in ("length", "stop"):  # cut short: no decode half will come for it
            await asyncio.to_thread(self._remove, [key])

    async def close(self) -> None:
        """Stop sweeping and remove what this engine wrote that no decode half has read (it will not be now)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper])
        written, self._written = list(self._written), {}
        await asyncio.to_thread(self._remove, written)

    async def _sweep_every(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            cutoff = time.time() - MAX_AGE_S
            self._written = {key: at for key, at in self._written.items() if at >= cutoff}
            await asyncio.to_thread(sweep, self.folder)

    def _remove(self, keys: list[str]) -> None:
        for key in keys:
            shutil.rmtree(self.folder / key, ignore_errors=True)
