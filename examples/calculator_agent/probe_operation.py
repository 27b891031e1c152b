"""How often a model's first tool call would use the operation the words ask for, by teacher forcing.

    python examples/calculator_agent/probe_operation.py MODEL_DIR      # a warmed-up model or a run's checkpoint

For 40 problems of each kind (`+`, `*`; settings as configs/agent.yaml, seeds from 10000, problems where both
operations give the same answer left out) it scores the first reply, a call on the question's numbers, once
with each operation, and prints the mean probability of the right one between the two (the numbers after
the operation are scored too, so this is the call's probability, not the operation token's alone).
"""

import asyncio
import math
import sys

import torch
from calculator import result_text
from problems import ProblemSettings, make_problem
from transformers import AutoModelForCausalLM, AutoTokenizer
from warmup import Transcript, render

from rollart.rollout.render import ChatRenderer

settings = ProblemSettings(ops="+*", max_number=9, max_second=3)


def first_reply_logp(model, ids, mask):
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


async def main(path):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    renderer = ChatRenderer(tok)
    stats = {"+": [], "*": []}
    seed = 10_000
    while min(len(v) for v in stats.values()) < 40:
        p = make_problem(seed, settings)
        seed += 1
        op = p.expression.split()[1]
        if len(stats[op]) >= 40 or p.numbers[0] + p.numbers[1] == p.numbers[0] * p.numbers[1]:
            continue
        lps = {}
        for o in "+*":
            expr = f"{p.numbers[0]} {o} {p.numbers[1]}"
            r = result_text({"expression": expr})
            ids, mask = await render(Transcript(p, expr, r, r), renderer)
            lps[o] = first_reply_logp(model, ids, mask)
        other = "*" if op == "+" else "+"
        stats[op].append(1 / (1 + math.exp(lps[other] - lps[op])))
    for op, v in stats.items():
        print(f"{path}: asked {op}: P(the right operation) {sum(v) / len(v):.3f}, mean of {len(v)} problems")


asyncio.run(main(sys.argv[1]))
