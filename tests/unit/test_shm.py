"""Shared memory for staged weights (`rollart.shm`): another process maps a segment by its path and sees the same
bytes, `locate` finds any view's segment and offset, and a closed segment leaves nothing to open."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from rollart.cpus import per_worker
from rollart.shm import Segment, attach, locate


def test_another_process_reads_a_segment_by_its_path() -> None:
    segment = Segment(4096)
    segment.buffer[:5].copy_(torch.tensor(list(b"hello"), dtype=torch.uint8))
    code = f"from rollart.shm import attach; print(bytes(attach({segment.path!r}, 4096)[:5]).decode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "hello"
    assert not any(segment.path.endswith(name) for name in os.listdir("/dev/shm"))  # no name in any file system


def test_locate_finds_a_view_of_any_dtype_and_nothing_outside() -> None:
    segment = Segment(1024)
    view = segment.buffer[128:256].view(torch.float32).view(4, 8)
    assert locate(view) == (segment, 128)
    assert locate(segment.buffer) == (segment, 0)
    assert locate(torch.zeros(4)) is None
    assert locate(segment.buffer[:64].view(torch.float32).view(4, 4).t()) is None  # not contiguous: not sendable


def test_a_closed_segment_cannot_be_attached_and_is_forgotten() -> None:
    segment = Segment(64)
    path, view = segment.path, segment.buffer[:8]
    segment.close()
    with pytest.raises(ConnectionError, match="cannot open the shared weights"):
        attach(path, 64)
    assert locate(view) is None
    view.fill_(1)  # the memory itself lives while a tensor views it
    del segment
    gc.collect()
    assert int(view.sum()) == 8


def test_attach_refuses_a_segment_smaller_than_said() -> None:
    segment = Segment(64)
    with pytest.raises(ConnectionError, match="hold 64 bytes; expected 128"):
        attach(segment.path, 128)


def test_per_worker_splits_cores_evenly_and_shares_them_when_too_few() -> None:
    assert per_worker((0, 1), 2) == [(0,), (1,)]
    assert per_worker((0, 1, 2, 3, 4), 2) == [(0, 1, 2), (3, 4)]
    assert per_worker((1,), 2) == [(1,), (1,)]
    assert per_worker((4, 5, 6), 1) == [(4, 5, 6)]
    with pytest.raises(ValueError):
        per_worker((), 2)
