"""What every test of the vLLM engine in-process is marked with."""

from __future__ import annotations

import pytest


def vllm_engine_marks(timeout_s: int) -> list[pytest.MarkDecorator]:
    return [
        pytest.mark.slow,
        pytest.mark.asyncio(loop_scope="module"),
        pytest.mark.timeout(timeout_s),
        # Raised inside torch while vLLM imports it; nothing this project calls.
        pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
        # vLLM closes its client's sockets but leaves their zmq context to the garbage collector, which close() runs.
        pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    ]
