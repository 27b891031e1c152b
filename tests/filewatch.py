"""Which files appear or are written in some folders while a block runs: Linux inotify (`inotify_simple`).

    with FileWatch([tmpdir, Path("/dev/shm"), run_dir]) as watch:
        ...                                   # a weight push
    assert watch.touched() == []

Every folder under the roots that exists when the watch starts is watched. A file or folder created in one, or
moved into one (`IN_CREATE`, `IN_MOVED_TO`), and a write to a file in one (`IN_MODIFY`) is reported, as its path;
so is a file created and deleted again before the block ends (events are queued by the kernel as they happen and
read at the end). A folder created during the block is reported; what is written inside it is not (it was not
watched), which cannot hide it: its folder already failed the check. inotify does not see writes through a shared
mapping of a file that existed before (vLLM's shared-memory ring buffers); those create nothing. An overflowing
event queue raises rather than passing quietly.

Other processes on the machine write to /tmp and /dev/shm too: point TMPDIR at a folder of the test's own
(`private_tmpdir`) and keep the watched block short.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from inotify_simple import INotify, flags

WATCHED = flags.CREATE | flags.MOVED_TO | flags.MODIFY
SHM = Path("/dev/shm")


class FileWatch:
    """A context manager: `touched()` afterwards lists the paths created or written under the roots meanwhile."""

    def __init__(self, roots: Iterable[Path]) -> None:
        self.roots = [Path(root) for root in roots]
        self._inotify: INotify | None = None
        self._folders: dict[int, Path] = {}
        self._touched: list[str] | None = None

    def __enter__(self) -> FileWatch:
        self._inotify = INotify()
        for root in self.roots:
            for folder, _, _ in os.walk(root):
                self._folders[self._inotify.add_watch(folder, WATCHED | flags.ONLYDIR)] = Path(folder)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        assert self._inotify is not None
        with self._inotify:
            events = list(self._inotify.read(timeout=0))
        touched = []
        for event in events:
            if event.mask & flags.Q_OVERFLOW:
                raise AssertionError("inotify's event queue overflowed: the watch cannot tell what was written")
            if event.mask & WATCHED:
                path = str(self._folders[event.wd] / event.name)
                if path not in touched:
                    touched.append(path)
        self._touched = touched

    def touched(self) -> list[str]:
        """Paths created, moved in or written during the block, first event first."""
        assert self._touched is not None, "touched() is for after the block"
        return list(self._touched)


@contextmanager
def private_tmpdir(folder: Path) -> Iterator[Path]:
    """TMPDIR (and `tempfile`'s cached default) set to `folder` for the block; processes started in it inherit
    it. Restored afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    saved_env, saved_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None
    try:
        yield folder
    finally:
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        tempfile.tempdir = saved_default
