"""The KV store's vLLM-free half: which key each half of a disaggregated turn uses, and the sweep of abandoned
prefills. The connector inside vLLM is tests/slow/test_vllm_kv_handoff.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rollart.generation.engine import SamplingParams
from rollart.generation.kv_store import KV_ARG, READING, KVStore, kv_key, sweep
from rollart.generation.vllm.args import vllm_sampling_params


def test_the_decode_half_reads_the_key_its_prefill_half_wrote() -> None:
    stored = KVStore.handoff("traj-3/turn-1/prefill", SamplingParams(max_tokens=8, prefill_only=True))
    loaded = KVStore.handoff("traj-3/turn-1", SamplingParams(max_tokens=8, kv_from="gen-c/traj-3/turn-1/prefill"))
    assert stored == ("store", kv_key("traj-3/turn-1/prefill"))
    assert loaded == ("load", kv_key("traj-3/turn-1/prefill"))
    assert KVStore.handoff("traj-3/turn-1", SamplingParams(max_tokens=8)) is None
    assert kv_key("a/b") != kv_key("a/c") and all(c in "0123456789abcdef" for c in kv_key("../..//x"))


def test_sweep_removes_only_what_was_abandoned(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    assert sweep(store) == 0 and store.is_dir()  # made when missing
    old, fresh = store / "old", store / "fresh"
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "layer.safetensors").write_bytes(b"kv")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert sweep(store, max_age_s=600) == 1
    assert sorted(p.name for p in store.iterdir()) == ["fresh"]


def test_vllm_is_asked_for_the_handoff_only_when_a_half_asks() -> None:
    pytest.importorskip("vllm", reason="vLLM builds its own sampling parameters: run in .venv-vllm")
    params = vllm_sampling_params(SamplingParams(max_tokens=8, prefill_only=True), ("store", "k"))
    assert (params.max_tokens, params.extra_args) == (1, {KV_ARG: ["store", "k"]})
    assert vllm_sampling_params(SamplingParams(max_tokens=8)).extra_args is None


async def test_what_each_half_leaves_is_removed_once_it_is_of_no_use(tmp_path: Path) -> None:
    store = KVStore(tmp_path / "kv")
    await store.start()

    def written(request_id: str) -> Path:
        folder = store.folder / kv_key(request_id)
        folder.mkdir()
        return folder

    kept, aborted, unread = written("a/prefill"), written("b/prefill"), written("c/prefill")
    await store.ended(("store", kv_key("a/prefill")), "length")  # for its decode half
    await store.ended(("store", kv_key("b/prefill")), None)  # cut short: no decode half will come
    await store.ended(("store", kv_key("c/prefill")), "stop")
    assert kept.exists() and not aborted.exists() and unread.exists()
    claimed = kept.rename(kept.with_name(kept.name + READING))  # as the decoding engine's scheduler does
    other_engines = written("d/prefill")  # written by another engine: not this one's to remove at close
    await store.close()
    assert claimed.exists() and not unread.exists() and other_engines.exists()
    # A decode half's folder is its engine's connector's to remove (tests/slow/test_vllm_kv_handoff.py): it may
    # still be read when the request is cut short out here.
    await store.ended(("load", kv_key("a/prefill")), None)
    assert claimed.exists()
