"""Agent programs for the agent-episode tests: each a plain script with the `openai` package, as a user's
agent would be, run by the env-host once per episode (`env: agent`).

    python agent_programs.py chat     two turns, then reports reward 1 when its episode seed is even, else 0
    python agent_programs.py flaky    as chat, but exits 3 after its first turn when its seed is a multiple of 3
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

import openai


def report(reward: float, success: bool) -> None:
    """The program's account of its episode (`POST <base_url>/rollart/report`)."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/rollart/report",
        data=json.dumps({"reward": reward, "success": success}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.load(response) == {"ok": True}


def main(mode: str) -> int:
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the env-host
    seed = int(os.environ["ROLLART_EPISODE_SEED"])
    messages: list[dict[str, str]] = [{"role": "user", "content": f"ab{seed % 7}"}]
    first = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    if mode == "flaky" and seed % 3 == 0:
        print("the agent gives up", file=sys.stderr)
        return 3
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "b"},
    ]
    client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    report(1.0 if seed % 2 == 0 else 0.0, success=seed % 2 == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
