"""The calculator agent: solves one arithmetic word problem with a calculator tool, over several turns, as a
plain program with the `openai` package.

    OPENAI_BASE_URL=http://.../v1 OPENAI_API_KEY=... ROLLART_EPISODE_SEED=7 python examples/calculator_agent/agent.py

RollArt's env-host runs it once per episode of an `env: agent` task (configs/agent.yaml), with those variables
set to the episode's own endpoint, key and seed. The seed picks the problem (`problems.make_problem`). Then,
up to `MAX_TURNS` times, it asks the model for its next turn with the calculator among the `tools`:

- a tool call: the calculator runs (`calculator.result_text`, no `eval`) and its result goes back as a `tool`
  message;
- a tool call the endpoint could not parse (HTTP 422, `malformed_tool_call`): the model's reply as it wrote it
  and the error as a user message, and the next turn;
- plain text: the final answer, the last number in it.

At the end it reports its reward, 1.0 when the answer is right and came after a call the calculator
evaluated, 0.0 otherwise (the task is to solve the problem with the tool: a guess without it, even a right
one, scores nothing), with `success` and the answer (`POST <base_url>/rollart/report`), and exits 0. An
episode closed under it (cancelled, too stale, the run over: HTTP 409) ends it with status 2 and one line on
stderr.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import openai
from calculator import NAME, TOOL, result_text
from problems import Problem, ProblemSettings, make_problem, opening

MAX_TURNS = 4
"""Calls to the model per episode (the task's `max_turns` should allow as many)."""
MODEL = "policy"
"""The endpoint serves the run's policy whatever the name."""
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def solve(client: openai.OpenAI, problem: Problem) -> tuple[str | None, bool]:
    """The model's final answer to `problem` (the last number of its final reply, or None without one), and
    whether the calculator evaluated one of its calls before it."""
    messages: list[Any] = [*opening(problem)]  # OpenAI chat messages, as plain dicts
    tools: list[Any] = [TOOL]
    evaluated = False
    for _ in range(MAX_TURNS):
        try:
            response = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        except openai.UnprocessableEntityError as exc:  # the model's tool call could not be parsed
            error = exc.body if isinstance(exc.body, dict) else {}
            messages += [
                {"role": "assistant", "content": error.get("reply", "")},
                {"role": "user", "content": f"Error: {error.get('message', exc.message)}"},
            ]
            continue
        except openai.BadRequestError as exc:
            if exc.code in ("turn_limit", "context_length_exceeded"):  # the task's budget is spent
                return None, evaluated
            raise
        message = response.choices[0].message
        if not message.tool_calls:
            numbers = NUMBER.findall(message.content or "")
            return (numbers[-1] if numbers else None), evaluated
        # The reply as the endpoint returned it, then one result per call: the same sequence goes on.
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls if c.type == "function"]
        messages.append(
            {
                "role": "assistant",
                "content": message.content or "",
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
                    for i, name, arguments in calls
                ],
            }
        )
        results = [(i, run_tool(name, arguments)) for i, name, arguments in calls]
        evaluated = evaluated or any(not result.startswith("error") for _, result in results)
        messages += [{"role": "tool", "tool_call_id": i, "content": result} for i, result in results]
    return None, evaluated


def run_tool(name: str, arguments: str) -> str:
    """The result of one tool call, as the `tool` message's content."""
    if name != NAME:
        return f"error: no tool {name!r}"
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    return result_text(parsed)


def is_right(answer: str | None, problem: Problem) -> bool:
    return answer is not None and abs(float(answer) - problem.answer) < 1e-6


def main() -> int:
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY; a retry would be another turn
    problem = make_problem(int(os.environ["ROLLART_EPISODE_SEED"]), ProblemSettings.from_environ(os.environ))
    try:
        answer, evaluated = solve(client, problem)
        right = evaluated and is_right(answer, problem)
        report = {"reward": 1.0 if right else 0.0, "success": right, "answer": answer}
        client.post("/rollart/report", cast_to=object, body=report)
    except openai.ConflictError as exc:  # 409: the episode was closed; nothing more to do or say
        print(f"calculator agent: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
