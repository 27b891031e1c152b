"""What the launchers say when a node ends: the error that ended it, read from its log (`read_last_error`), in
the line that names the node and its log (`describe_end`), whether the node logged its failure or died before
its logging was up."""

from __future__ import annotations

import json
from pathlib import Path

from rollart.launch.terminal import describe_end
from rollart.node import read_last_error

TRACEBACK = """Traceback (most recent call last):
  File "x.py", line 1, in <module>
    start()
KeyError: 'old'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "x.py", line 3, in <module>
    raise RuntimeError("Given number of CPU id list ['1'] doesn't match local world size 2")
RuntimeError: Given number of CPU id list ['1'] doesn't match local world size 2
(EngineCore pid=12) INFO 12-07 17:26:51 [core.py:1454] shutting down
"""


def failed(error: str) -> str:
    return json.dumps({"event": "node.failed", "error": error, "level": "error"})


def test_the_nodes_own_failure_lines_name_every_cause_once(tmp_path: Path) -> None:
    log = tmp_path / "gen.log"
    earlier = failed("OSError: from the run before") + "\n"
    log.write_text(
        earlier
        + json.dumps({"event": "generator.ready"})
        + "\n"
        + failed("EngineClosed: vLLM engine: swapping in version 3 failed")
        + "\n"
        + failed("EngineClosed: vLLM engine: swapping in version 3 failed")
        + "\n"
        + TRACEBACK
    )
    assert read_last_error(log, len(earlier)) == "EngineClosed: vLLM engine: swapping in version 3 failed"
    line = describe_end("gen-0", 1, log, len(earlier))
    assert (
        line == f"node gen-0 exited with code 1: EngineClosed: vLLM engine: swapping in version 3 failed (log: {log})"
    )


def test_without_failure_lines_the_last_traceback_says_it(tmp_path: Path) -> None:
    log = tmp_path / "gen.log"
    log.write_text(json.dumps({"event": "generator.starting"}) + "\n" + TRACEBACK)
    assert read_last_error(log) == "RuntimeError: Given number of CPU id list ['1'] doesn't match local world size 2"


def test_a_clean_exit_or_a_log_without_an_error_names_only_the_log(tmp_path: Path) -> None:
    log = tmp_path / "gen.log"
    log.write_text(json.dumps({"event": "node.drained"}) + "\n")
    assert read_last_error(log) is None
    assert describe_end("gen-0", -9, log) == f"node gen-0 was killed by SIGKILL (log: {log})"
    assert (
        describe_end("gen-0", 0, tmp_path / "missing.log")
        == f"node gen-0 exited with code 0 (log: {tmp_path}/missing.log)"
    )
