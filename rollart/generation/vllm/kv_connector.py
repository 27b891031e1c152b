"""The KV store connector: how one vLLM engine prefills a prompt and another decodes it (`rollout.routing:
disaggregated` on `generator.backend: vllm` with `generator.kv_store`).

vLLM hands KV cache between engines through a KV connector (`KVTransferConfig`), a class vLLM loads in its
scheduler and in its workers. This one extends vLLM's reference connector (`ExampleConnector`: each layer's KV of a
prompt's whole blocks written to, and read from, safetensors files in a folder every engine can reach) in the one
way a rollout needs: KV moves **only for the requests that ask**, under **their own key**, not for every prompt
under a hash of its tokens. The reference keys by token ids alone, so a prompt cached under old weights would serve
a request under new ones, and every request of every engine would be written out.

- A prefill half (`SamplingParams.prefill_only`) runs with one token to generate and the sampling argument
  `rollart_kv = ("store", key)`: its prompt's whole blocks are written under `<kv_store>/<key>/` during the
  forward pass that completes its prefill (the last chunk of a prompt longer than vLLM's batched-token budget);
- the decode half (`kv_from`) runs with `rollart_kv = ("load", key)`: if the folder is there, the scheduler
  claims it (renames it, so nothing removes it while it is read), counts those tokens as computed and allocates
  their blocks, and this connector fills them from the files before the forward pass; vLLM computes the prompt's
  remainder (at least its last token) and decodes. No folder, no load: the engine prefills the whole prompt, so
  a lost handoff costs time, never a wrong token. As in the reference, every stored block is loaded, over any
  the engine found in its own prefix cache (a chat template's header, say): those hold the same prompt's KV,
  computed there under a version at most alpha apart, the same lag as the handoff itself;
- the reading engine removes the folder, always after the read and never during it: its worker once it has
  loaded the KV (before the forward pass that uses it), its scheduler when the request ends without its load ever
  handed to the worker (cut short while waiting: claimed and not read, or not even claimed). A request loads at
  most once (a preempted one computes its prompt again). What a turn given up between its halves left is removed by
  `rollart.generation.kv_store.KVStore`.

The key names the prefill request (`kv_store.kv_key`): the proxy sends the decode half `kv_from = "<generator>/<prefill
request id>"`. On one machine the folder can be in memory (`/dev/shm`); across hosts it is a shared filesystem,
which suits tests and small clusters. The production route between GPU nodes is a transfer connector (vLLM's NIXL
connector, which moves blocks GPU to GPU and passes its block ids with the request); it is not wired here.

vLLM imports this module in its own processes; it needs vLLM (the side outside vLLM is
`rollart.generation.kv_store`).
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (  # type: ignore[import-not-found,unused-ignore]
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)

from rollart.generation.kv_store import KV_ARG, READING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.request import Request  # type: ignore[import-not-found,unused-ignore]


def _stored(prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt whose KV is handed on: its whole blocks, short of the last token (which the decoding
    engine computes, for the logits of the first token it samples); what the reference connector's metadata
    (`ReqMeta.make_meta`) writes and reads."""
    return int(align_to_block_size(prompt_tokens, block_size))


def _wanted(sampling_params: Any) -> tuple[str, str] | None:
    """("store" | "load", key) when the request asks for a handoff."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    value = extra.get(KV_ARG)
    return None if value is None else (str(value[0]), str(value[1]))


class RollartKVStore(ExampleConnector):  # type: ignore[misc,unused-ignore]
    """vLLM's reference connector, writing and reading only the requests that ask, under their key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefilling: dict[str, tuple[list[int], str, list[int]]] = {}
        """Scheduler side: prefill halves whose prompt is not yet wholly computed: prompt, key, block ids."""
        self._claimed: dict[str, str] = {}
        """Scheduler side: decode halves that claimed their key, not yet handed to the worker to read."""
        self._handed: set[str] = set()
        """Scheduler side: decode halves whose read went to the worker (which removes the folder once read)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        wanted = _wanted(request.sampling_params)
        if wanted is None or wanted[0] != "load" or not self._claim(request.request_id, wanted[1]):
            return 0, False
        return max(0, _stored(len(request.prompt_token_ids or []), self._block_size) - num_computed_tokens), False

    def _claim(self, req_id: str, key: str) -> bool:
        """Whether the folder of `key` is `req_id`'s to read: claimed by an earlier call for this request, or renamed
        to its claimed name now (atomic: a folder another engine claimed, for a decode half re-sent there, is not
        this one's, and nothing removes a claimed folder in the middle of a read). A request reads at most once."""
        if req_id in self._claimed:
            return True
        if req_id in self._handed:  # read already (preempted since): it computes its prompt again
            return False
        claimed = self._folder(key + READING)
        try:
            os.rename(self._folder(key), claimed)
        except OSError:  # never written, given up, or another engine's: the engine prefills the prompt itself
            return False
        os.utime(claimed)  # its age, for the sweeps, counts from now
        self._claimed[req_id] = key
        return True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            wanted = _wanted(new.sampling_params)
            token_ids = new.prompt_token_ids or []
            if new.req_id in self._requests_need_load:
                assert wanted is not None
                meta.add_request(token_ids, new.block_ids[0], self._block_size, False, [wanted[1] + READING])
                self._hand(new.req_id)
            elif wanted is not None and wanted[0] == "store" and _stored(len(token_ids), self._block_size):
                self._prefilling[new.req_id] = (token_ids, wanted[1], list(new.block_ids[0]))
                self._store_if_prefilled(meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids  # new_block_ids is then all of its blocks
            new_blocks = cached.new_block_ids[i]
            if (entry := self._prefilling.get(req_id)) is not None:
                if new_blocks is not None:
                    entry[2][:] = [*([] if resumed else entry[2]), *new_blocks[0]]
                self._store_if_prefilled(meta, req_id, cached.num_computed_tokens[i] + scheduled[req_id])
            # A loading request that was preempted before its first step is loaded when it resumes.
            request = self._requests_need_load.get(req_id)
            if request is None or not resumed:
                continue
            wanted = _wanted(request.sampling_params)
            assert wanted is not None and new_blocks is not None
            total = cached.num_computed_tokens[i] + scheduled[req_id]
            meta.add_request(
                request.all_token_ids[:total], new_blocks[0], self._block_size, False, [wanted[1] + READING]
            )
            self._hand(req_id)
        self._requests_need_load.clear()
        return meta

    def _hand(self, req_id: str) -> None:
        """The read of `req_id`'s claimed folder is in this step's metadata: the worker reads it, then removes it."""
        self._claimed.pop(req_id, None)
        self._handed.add(req_id)

    def _store_if_prefilled(self, meta: ExampleConnectorMetadata, req_id: str, computed_after_step: int) -> None:
        """Write the prompt's KV in this step if the step completes its prefill (a prompt prefilled over several
        steps, by chunked prefill, is written at its last: its blocks all hold its KV then)."""
        token_ids, key, block_ids = self._prefilling[req_id]
        if computed_after_step >= len(token_ids):
            meta.add_request(token_ids, block_ids, self._block_size, True, [key])
            del self._prefilling[req_id]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._prefilling.pop(req_id, None)  # aborted before its prompt was prefilled
        claimed = self._claimed.pop(req_id, None)
        wanted = _wanted(request.sampling_params)
        if req_id in self._handed:
            self._handed.discard(req_id)  # the worker read the folder and removed it
        elif claimed is not None:  # cut short between its claim and its first step: nothing will read it now
            shutil.rmtree(self._folder(claimed + READING), ignore_errors=True)
        elif wanted is not None and wanted[0] == "load":  # cut short before it claimed: nor will anything read this
            shutil.rmtree(self._folder(wanted[1]), ignore_errors=True)
        return super().request_finished(request, block_ids)  # type: ignore[no-any-return,unused-ignore]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker side: read this step's decode halves' KV into their blocks, then remove what was read (this
        engine was its one reader; the scheduler claimed it)."""
        super().start_load_kv(forward_context, **kwargs)
        metadata = self._get_connector_metadata()
        for request in metadata.requests:
            if not request.is_store:
                shutil.rmtree(self._folder(request.mm_hashes[0]), ignore_errors=True)

    def _generate_foldername_debug(self, token_ids: Any, mm_hashes: list[str], create_folder: bool = False) -> str:
        """The request's own folder: its key (or claimed key) travels in `mm_hashes` (the reference's salt), never a
        token hash."""
        folder = self._folder(mm_hashes[0])
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    def _folder(self, key: str) -> str:
        return os.path.join(self._storage_path, key)
