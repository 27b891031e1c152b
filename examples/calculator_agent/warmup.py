"""Format warm-up for the calculator agent: supervised steps that teach a model built from scratch the shape of
an episode (call the calculator, then answer with a number), never how to solve a problem.

    python examples/calculator_agent/warmup.py MODEL_DIR [--steps 120] [--answer result|random] [--ops +]

builds the BPE test model in MODEL_DIR when it has none (`rollart.models.qwen3_bpe`) and trains it in place on
generated transcripts, printing the loss of each step. RL cannot be expected to find Qwen3's tool-call format
from a random initialisation alone, as it cannot find `\\boxed{}` (`rollart.tiny.warmup`, the default run's
warm-up, which this one follows): the transcripts are played by a random policy that is valid but knows
nothing of the problem.

Each transcript is one episode as `agent.py` plays it, for a problem from the generator (`problems.py`):

1. the agent's opening (system prompt, the question) with the calculator among the `tools`;
2. the model's tool call, `calculator` with the expression of **another** problem drawn independently (random
   operands in the task's range and a random one of its operations: the right shape and nothing else), or with
   `--operands question` the question's two numbers, in its order, joined by a random one of the task's
   operations (the tool is given what the question says; which operation it asks for, never);
3. the calculator's result for that expression, as a `tool` message;
4. the model's final answer, a number: with `--answer result` (the default) the calculator's result, with
   `--answer random` the answer of yet another independent problem.

With `--call-fraction F` below 1, only a fraction F of the transcripts go so; the others answer at once
(steps 2 and 3 left out) with the answer of another independent problem: a guess, which `agent.py` never pays.
Both are valid ways to end an episode; which one pays is left to RL.

It is rendered through the endpoint itself: the agent's messages go to an `AgentEpisode` (the class the
env-host serves each episode with) whose generator replies with the transcript's texts as token ids, so the
prompt, the `tools` block, the tool result and the generation prompts are the tokens the trainer will get,
and the loss is on the replies' tokens alone (`rollart.tiny.warmup.supervised_warmup`).

What it teaches: to call `calculator` with `{"expression": "a op b"}` in Qwen3's `<tool_call>` format, once,
then to end the episode with a bare number, and (`--answer result`) that this number is what the calculator
said: how a tool's output is used, as the default warm-up teaches which moves move. The format takes about 100
steps of 8 transcripts; that copy takes more than 260 (README.md, "What the warm-up teaches").
What it does not: which numbers and which operation a question asks for. The expression never depends on the
question, so the answer is right only by chance (about 1 in 5 with `+` up to 3, 1 in 15 with `+-` up to 9, as
a random answer): the warmed-up model's success rate is that chance, and reading the question into the
expression is left to RL. The operands are drawn independently, not kept apart from the question's: a rule that avoided
the question's numbers would teach the model to avoid them. With `--operands question` the call takes the
question's numbers, and which operation the words ask for is left to RL: the operation is drawn uniformly and
independently of the question, so the warmed-up model is right about as often as a random operation is (1 in 3
with `+-*`, a little more where two operations agree, as 2 + 2 and 2 * 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
from calculator import NAME, TOOL, number_text, result_text
from problems import Problem, ProblemSettings, make_problem, opening

from rollart.agents import AgentEpisode
from rollart.protocol.messages import Generate, Generated
from rollart.rollout.config import SamplingSpec, TaskSpec
from rollart.rollout.render import ChatRenderer
from rollart.tiny.warmup import Rows, supervised_warmup

Answer = Literal["result", "random"]
Operands = Literal["random", "question"]
POLICY = "calculator-transcripts"
"""Recorded in the model's marker file (`format_warmup.policy`, beside `answer`)."""
DEFAULT_SETTINGS = ProblemSettings()
TASK = TaskSpec(name="calculator", env="agent", thinking=False, max_turns=4, max_tokens_per_turn=64)
"""What of configs/agent.yaml's task the rendering depends on: its chat options (`thinking: false`)."""


@dataclass(frozen=True)
class Transcript:
    """One warm-up episode: a problem, and what the random valid policy says to it."""

    problem: Problem
    expression: str | None
    """The tool call's expression: another problem's, independent of this one (None: no call, an answer at
    once)."""
    result: str | None
    """What the calculator answers to it."""
    answer: str
    """The final reply."""

    @property
    def replies(self) -> tuple[str, ...]:
        """The model's turns as it writes them: a call and the answer, or the answer alone."""
        if self.expression is None:
            return (self.answer,)
        return tool_call_text(self.expression), self.answer


def tool_call_text(expression: str) -> str:
    """A call of the calculator as Qwen3's chat template writes one (and the endpoint parses it)."""
    arguments = json.dumps({"expression": expression})
    return '<tool_call>\n{"name": "' + NAME + '", "arguments": ' + arguments + "}\n</tool_call>"


def draw(
    problem: Problem,
    rng: random.Random,
    settings: ProblemSettings,
    answer: Answer = "result",
    operands: Operands = "random",
    *,
    call_fraction: float = 1.0,
) -> Transcript:
    """The random valid policy's episode on `problem`: nothing it says depends on the problem, but for
    `operands="question"` the call's two numbers (its operation is still drawn at random). With
    `call_fraction` below 1, that fraction of the episodes call the calculator; the others answer at once with
    another problem's answer."""
    if call_fraction < 1 and rng.random() >= call_fraction:
        return Transcript(problem, None, None, number_text(make_problem(rng.randrange(2**31), settings).answer))
    if operands == "question":
        a, b = problem.numbers
        expression = f"{a} {rng.choice(settings.ops)} {b}"
    else:
        expression = make_problem(rng.randrange(2**31), settings).expression
    result = result_text({"expression": expression})
    final = result if answer == "result" else number_text(make_problem(rng.randrange(2**31), settings).answer)
    return Transcript(problem, expression, result, final)


async def render(transcript: Transcript, renderer: ChatRenderer, task: TaskSpec = TASK) -> tuple[list[int], list[int]]:
    """`transcript` as the trainer gets the episode: its token ids and the mask of the model's own."""
    replies, stop = list(transcript.replies), renderer.turn_end_id
    if stop is None:
        raise ValueError("the model's chat template ends no turn with a token of its own: no Qwen3 template")

    async def reply(request: Generate) -> Generated:
        ids = [*renderer.encode(replies.pop(0)), stop]
        return Generated(request.request_id, ids, [0.0] * len(ids), [0] * len(ids), "stop", len(request.prompt_ids), "")

    episode = AgentEpisode("warmup", task=task, sampling=SamplingSpec(), renderer=renderer, generate=reply)
    messages: list[dict[str, Any]] = [*opening(transcript.problem)]
    first = await episode.chat(messages, tools=[TOOL], allowed={NAME})
    if transcript.expression is None:  # an answer at once: the episode is its one reply
        return rendered(episode)
    (call,) = first.tool_calls
    call_id = "call-0"
    # As agent.py sends them back: the reply as the endpoint returned it, then the calculator's result.
    messages += [
        {"role": "assistant", "content": first.content or "", "tool_calls": [call.openai(call_id)]},
        {"role": "tool", "tool_call_id": call_id, "content": transcript.result},
    ]
    await episode.chat(messages, tools=[TOOL], allowed={NAME})
    return rendered(episode)


def rendered(episode: AgentEpisode) -> tuple[list[int], list[int]]:
    """The token ids of the episode's one sequence and the mask of the model's own."""
    history, prompt = episode.history, episode.prompt_ids or []
    if history.segments:
        raise RuntimeError("the episode's second call did not continue its first: the warm-up would not match it")
    return prompt + history.ids, [0] * len(prompt) + history.mask


def weigh_answer(mask: list[int], weight: float) -> list[float]:
    """The loss weights of a rendered transcript: its final reply's tokens (the last run of the model's own,
    its end of turn included) weigh `weight`, the tool call's 1."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return [float(m) * (weight if start <= i < end else 1.0) for i, m in enumerate(mask)]


def batch_of(
    transcripts: int,
    settings: ProblemSettings,
    answer: Answer,
    answer_weight: float = 1.0,
    operands: Operands = "random",
    *,
    call_fraction: float = 1.0,
) -> Callable[[ChatRenderer, random.Random], Rows]:
    """A `supervised_warmup` batch maker: `transcripts` episodes on problems of random seeds. The answer after a
    call weighs `answer_weight`; an answer at once weighs 1, as a call does (its first token is the choice
    between the two, learned at the rate the transcripts make it)."""

    def batch(renderer: ChatRenderer, rng: random.Random) -> Rows:
        async def play() -> Rows:
            problems = [make_problem(rng.randrange(2**31), settings) for _ in range(transcripts)]
            rows = []
            for problem in problems:
                transcript = draw(problem, rng, settings, answer, operands, call_fraction=call_fraction)
                ids, mask = await render(transcript, renderer)
                weight = answer_weight if transcript.expression is not None else 1.0
                rows.append((ids, weigh_answer(mask, weight)))
            return rows

        return asyncio.run(play())

    return batch


def warm_up(
    model_dir: Path,
    *,
    steps: int,
    transcripts: int = 8,
    lr: float = 5e-4,
    seed: int = 0,
    settings: ProblemSettings = DEFAULT_SETTINGS,
    answer: Answer = "result",
    answer_weight: float = 1.0,
    operands: Operands = "random",
    call_fraction: float = 1.0,
    log_every: int = 10,
) -> dict[str, Any]:
    """Warm up the model in `model_dir` in place (see the module docstring); returns the summary it records."""
    call = (
        "the question's numbers joined by a random operation"
        if operands == "question"
        else "an expression independent of the problem"
    )
    about = {
        "transcripts_per_step": transcripts,
        "what": f"tool-call transcripts: a call with {call}, then "
        + ("its result as the answer" if answer == "result" else "a random number as the answer")
        + " (never which operation the question asks for)",
        "operands": operands,
        "policy": POLICY,
        "answer": answer,
        "ops": settings.ops,
        "max_number": settings.max_number,
        "max_second": settings.max_second,
        "answer_weight": answer_weight,
        "call_fraction": call_fraction,
    }
    if call_fraction < 1:
        about["what"] += f"; {1 - call_fraction:.0%} of them answer at once with a random number instead"
    batch = batch_of(transcripts, settings, answer, answer_weight, operands, call_fraction=call_fraction)
    return supervised_warmup(model_dir, batch, steps=steps, lr=lr, seed=seed, about=about, log_every=log_every)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model_dir", type=Path, help="the model folder; the BPE test model is built there if it has none"
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--transcripts", type=int, default=8, help="transcripts per step")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0, help="of the transcripts, and of the model's weights if built")
    parser.add_argument("--answer", choices=["result", "random"], default="result")
    parser.add_argument(
        "--operands",
        choices=["random", "question"],
        default="random",
        help="of the tool call: another problem's, or the question's own joined by a random operation",
    )
    parser.add_argument(
        "--call-fraction",
        type=float,
        default=1.0,
        help="of the transcripts that call the calculator; the others answer at once with a random number",
    )
    parser.add_argument("--ops", default=ProblemSettings.ops, help="as the agent's CALCULATOR_OPS")
    parser.add_argument("--max-number", type=int, default=ProblemSettings.max_number, help="as CALCULATOR_MAX_NUMBER")
    parser.add_argument("--max-second", type=int, help="as CALCULATOR_MAX_SECOND (default: --max-number)")
    parser.add_argument(
        "--answer-weight", type=float, default=1.0, help="of the final reply's tokens in the loss (the call's: 1)"
    )
    parser.add_argument("--hidden-size", type=int, help="of a model built here (default: the BPE test model's)")
    parser.add_argument("--layers", type=int, help="of a model built here (default: the BPE test model's)")
    parser.add_argument(
        "--untied", action="store_true", help="a model built here gets an output layer of its own (README.md)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.call_fraction <= 1:
        parser.error(f"--call-fraction: expected a number in (0, 1]; got {args.call_fraction}")

    from rollart.models.qwen3_bpe import DEFAULT_SIZES, build_qwen3_bpe_model

    if not (args.model_dir / "config.json").exists():
        sizes = msgspec.structs.replace(
            DEFAULT_SIZES,
            hidden_size=args.hidden_size or DEFAULT_SIZES.hidden_size,
            num_layers=args.layers or DEFAULT_SIZES.num_layers,
            tie_embeddings=not args.untied,
        )
        print(f"building the BPE test model in {args.model_dir} ({sizes})", flush=True)
        build_qwen3_bpe_model(args.model_dir, seed=args.seed, sizes=sizes)
    elif args.hidden_size or args.layers or args.untied:
        parser.error(f"{args.model_dir} holds a model already: --hidden-size, --layers, --untied are for building one")
    settings = ProblemSettings(ops=args.ops, max_number=args.max_number, max_second=args.max_second)
    print(f"format warm-up of {args.model_dir}: {args.steps} steps of {args.transcripts} transcripts", flush=True)
    summary = warm_up(
        args.model_dir,
        steps=args.steps,
        transcripts=args.transcripts,
        lr=args.lr,
        seed=args.seed,
        settings=settings,
        answer=args.answer,
        answer_weight=args.answer_weight,
        operands=args.operands,
        call_fraction=args.call_fraction,
        log_every=1,
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    from rollart.logs import configure_logging

    configure_logging(json=False, stream=sys.stdout)  # each step's loss, as a line
    sys.exit(main())
