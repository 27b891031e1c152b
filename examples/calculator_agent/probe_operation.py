"""How often a model's first tool call would use the operation the words ask for, by teacher forcing.

    python examples/calculator_agent/probe_operation.py MODEL_DIR [CONFIG]   # a warmed-up model or a run's checkpoint

For 40 problems of each kind (`+`, `*`: the problems of the agent task in CONFIG, configs/agent.yaml by
default, which must draw from both; seeds from 10000, problems where both operations give the same answer
left out) it scores the first reply, a call on the question's numbers, once
with each operation, and prints the mean probability of the right one between the two (the numbers after
the operation are scored too, so this is the call's probability, not the operation token's alone).
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import torch
from calculator import result_text
from problems import ProblemSettings, make_problem
from transformers import AutoModelForCausalLM, AutoTokenizer
from warmup import Transcript, render

from rollart.rollout.render import ChatRenderer
from rollart.topology import load_topology

PER_KIND = 40


def problem_settings(config: Path) -> ProblemSettings:
    """The problems of the config's one agent task (its `agent.env`, as agent.py reads them)."""
    rollout = load_topology(config).run.rollout
    agents = [task.agent for task in (rollout.tasks if rollout else []) if task.agent is not None]
    if len(agents) != 1:
        sys.exit(f"{config}: expected one agent task, found {len(agents)}")
    settings = ProblemSettings.from_environ(agents[0].env)
    if set(settings.ops) != {"+", "*"}:
        sys.exit(f"{config}: the probe compares + and *; the task's problems are {settings.ops!r}")
    return settings


def first_reply_logp(model: torch.nn.Module, ids: list[int], mask: list[int]) -> float:
    """The log-probability of the episode's first reply (its first run of the model's own tokens)."""
    start = mask.index(1)
    end = start
    while end < len(mask) and mask[end]:
        end += 1
    x = torch.tensor([ids[:end]])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
    tgt = x[0, 1:]
    lp = logp.gather(1, tgt[:, None])[:, 0]
    return float(lp[start - 1 : end - 1].sum())


async def main(path: str, config: Path) -> None:
    settings = problem_settings(config)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    renderer = ChatRenderer(tok)
    stats: dict[str, list[float]] = {"+": [], "*": []}
    seed = 10_000
    while min(len(v) for v in stats.values()) < PER_KIND:
        p = make_problem(seed, settings)
        seed += 1
        op = p.expression.split()[1]
        if len(stats[op]) >= PER_KIND or p.numbers[0] + p.numbers[1] == p.numbers[0] * p.numbers[1]:
            continue
        lps: dict[str, float] = {}
        for o in "+*":
            expr = f"{p.numbers[0]} {o} {p.numbers[1]}"
            r = result_text({"expression": expr})
            ids, mask = await render(Transcript(p, expr, r, r), renderer)
            lps[o] = first_reply_logp(model, ids, mask)
        other = "*" if op == "+" else "+"
        stats[op].append(1 / (1 + math.exp(lps[other] - lps[op])))
    for op, v in stats.items():
        print(f"{path}: asked {op}: P(the right operation) {sum(v) / len(v):.3f}, mean of {len(v)} problems")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else "configs/agent.yaml")))
