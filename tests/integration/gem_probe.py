"""An env module for tests/integration/test_gem_env.py: `make_env("gem-probe")` reports, in its reset's
info, the interpreter and the libraries of the worker it runs in, so the test can tell which Python
environment its env workers ran in."""

from __future__ import annotations

import importlib.metadata
import sys

import msgspec

from rollart.envs import Env, Info, StepResult, register_env


def installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class GemProbe(Env):
    profile = "decode-heavy"
    max_turns = 1
    system_prompt = "test"

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        info = {
            "python": sys.executable,
            "msgspec": msgspec.__version__,
            "msgspec_file": msgspec.__file__,
            "gem_llm": installed("gem-llm"),
        }
        return "probe", info

    def step(self, action: str) -> StepResult:
        return "", 0.0, True, False, {}


register_env("gem-probe", GemProbe)
