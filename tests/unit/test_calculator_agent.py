"""The calculator agent example (examples/calculator_agent/): its safe calculator, its problems, its format
warm-up's transcripts, and `agent.py` run as the env-host runs it, against the endpoint in this process.

The episodes with `agent.py` are integration tests: a subprocess with the `openai` package talks HTTP to an
`AgentEndpoint` on loopback. The model that answers is `Scripted` (a model that learned the format, where
the test needs a tool call) or the real HF engine on the BPE test model (random weights: whatever it says,
the agent must play its episode to the end and report). `-k calculator_agent` selects them all.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import random
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rollart.agents import AgentEndpoint, AgentEpisode
from rollart.agents.tool_calls import parse_tool_calls
from rollart.models.checkpoint import generation_eos_ids
from rollart.rollout.config import SamplingSpec, TaskSpec
from rollart.rollout.render import ChatRenderer
from tests.unit.test_chat_render import load

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator_agent"


def example(name: str) -> ModuleType:
    """A module of the example, imported as its scripts import one another (their folder on the path)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    return importlib.import_module(name)


calculator, problems = example("calculator"), example("problems")


# -- the calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3 + 4", 7), ("9 - 12", -3), ("(2 + 3) * 4", 20), ("7 / 2", 3.5), ("-3 * -2", 6), (" 1.5 + 1 ", 2.5)],
)
def test_calculator_agent_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert calculator.calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "x + 1",  # a name
        "__import__('os').system('true')",  # a call
        "(1).real",  # an attribute
        "abs(-3)",
        "2 ** 3",  # a power, however small
        "9 ** 9 ** 9",
        "10 % 3",
        "'a' * 3",  # a string
        "True + 1",  # bool is an int to Python
        "[1, 2]",
        "lambda: 1",
        "1 / 0",
        "1 +",
        "9" * 16,  # past MAX_MAGNITUDE
        "99999999 * 99999999",
        "1 + " * 60 + "1",  # past MAX_CHARS
    ],
)
def test_calculator_agent_calculator_refuses_anything_but_numbers_and_four_operations(expression: str) -> None:
    with pytest.raises(calculator.CalculatorError):
        calculator.calculate(expression)
    assert calculator.result_text({"expression": expression}).startswith("error: ")


def test_calculator_agent_tool_results_are_short_numbers_or_errors() -> None:
    assert calculator.result_text({"expression": "3 + 4"}) == "7"
    assert calculator.result_text({"expression": "8 / 2"}) == "4"  # a whole quotient, not 4.0
    assert calculator.result_text({"expression": "1 / 3"}) == "0.333333"
    assert calculator.result_text({"expression": "5 / 2"}) == "2.5"
    assert calculator.result_text({"expr": "3 + 4"}).startswith("error: ")
    assert calculator.result_text({"expression": 7}).startswith("error: ")
    assert calculator.result_text("3 + 4").startswith("error: ")


# -- the problems -------------------------------------------------------------------------------------


def test_calculator_agent_problems_are_made_from_their_seed_with_their_answer() -> None:
    settings = problems.ProblemSettings(ops="+-*/", max_number=9)
    made = [problems.make_problem(seed, settings) for seed in range(400)]
    assert made == [problems.make_problem(seed, settings) for seed in range(400)]  # the same, every time
    assert len({p.question for p in made}) > 200  # and a seed's own
    assert problems.make_problem(7) == problems.make_problem(7, problems.ProblemSettings())
    for p in made:
        a, b = p.numbers
        assert calculator.calculate(p.expression) == p.answer >= 0 and p.answer == int(p.answer)
        assert p.expression.split()[0::2] == [str(a), str(b)] and f" {a} " in f" {p.question} "
    ops = {p.expression.split()[1] for p in made}
    assert ops == set("+-*/")
    small = [problems.make_problem(seed, problems.ProblemSettings(ops="+", max_number=3)) for seed in range(100)]
    assert all(p.expression.split()[1] == "+" and max(p.numbers) <= 3 for p in small)


def test_calculator_agent_problem_settings_come_from_the_agents_environment() -> None:
    assert problems.ProblemSettings.from_environ({}) == problems.ProblemSettings()
    given = problems.ProblemSettings.from_environ({"CALCULATOR_OPS": "*/", "CALCULATOR_MAX_NUMBER": "5"})
    assert (given.ops, given.max_number) == ("*/", 5)
    with pytest.raises(ValueError, match="ops"):
        problems.ProblemSettings(ops="+^")
    with pytest.raises(ValueError, match="max_number"):
        problems.ProblemSettings(max_number=0)


def test_calculator_agent_config_matches_the_agent_and_its_warmup() -> None:
    warmup, agent = example("warmup"), example("agent")
    task = config_task()
    assert task.agent is not None and task.agent.reward == "report"
    assert (ROOT / task.agent.command[1]).is_file()
    assert task.chat_options() == warmup.TASK.chat_options()  # the warm-up renders the run's prompts
    assert task.max_turns is not None and task.max_turns >= agent.MAX_TURNS
    # The problems are those the model was warmed up on: the warm-up command in the config's header.
    header = [line for line in (ROOT / "configs" / "agent.yaml").read_text().splitlines() if line.startswith("#")]
    flags = {k: v.strip("'") for k, v in re.findall(r"--(ops|max-number|max-second) (\S+)", " ".join(header))}
    warmed = problems.ProblemSettings(
        ops=flags["ops"],
        max_number=int(flags["max-number"]),
        max_second=int(flags["max-second"]) if "max-second" in flags else None,
    )
    assert problems.ProblemSettings.from_environ(task.agent.env) == warmed
    # ... into the folder the run loads.
    from rollart.topology import load_topology

    (folder,) = re.findall(r"warmup\.py (\S+)", " ".join(header))
    assert load_topology(ROOT / "configs" / "agent.yaml").run.model.path == folder


# -- the warm-up's transcripts ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renderer(qwen3_bpe_dir: Path) -> ChatRenderer:
    return ChatRenderer(load(qwen3_bpe_dir), stop_ids=generation_eos_ids(qwen3_bpe_dir))


def assistant_text(renderer: ChatRenderer, ids: list[int], mask: list[int]) -> list[str]:
    """The model's replies in a row: each run of masked tokens, decoded."""
    spans: list[list[int]] = []
    for i, (token, m) in enumerate(zip(ids, mask, strict=True)):
        if m:
            if i == 0 or not mask[i - 1]:
                spans.append([])
            spans[-1].append(token)
    return [renderer.decode(span) for span in spans]


@pytest.mark.parametrize("answer", ["result", "random"])
async def test_calculator_agent_warmup_transcripts_call_the_tool_then_answer_and_know_nothing_of_the_problem(
    renderer: ChatRenderer, answer: str
) -> None:
    warmup = example("warmup")
    settings = problems.ProblemSettings(ops="+-", max_number=9)  # room enough for a coincidence to be rare
    same_as_problem = 0
    for seed in range(30):
        problem = problems.make_problem(seed, settings)
        transcript = warmup.draw(problem, random.Random(seed), settings, answer)
        # The same draws on another problem say the same: nothing depends on the problem.
        other = warmup.draw(problems.make_problem(seed + 1000, settings), random.Random(seed), settings, answer)
        assert (other.expression, other.answer) == (transcript.expression, transcript.answer)
        same_as_problem += transcript.expression == problem.expression
        ids, mask = await warmup.render(transcript, renderer)
        call, final = assistant_text(renderer, ids, mask)
        content, (parsed,) = parse_tool_calls(call, allowed={"calculator"})
        assert content is None and parsed.name == "calculator"
        assert parsed.arguments == {"expression": transcript.expression}
        assert calculator.result_text(parsed.arguments) == transcript.result
        assert final == transcript.answer and float(final) == int(final)
        if answer == "result":
            assert final == transcript.result
        text = renderer.decode(ids)
        assert problem.question in text
        assert json.dumps(calculator.TOOL) in text  # the tools block, as the template writes it
        assert f"<tool_response>\n{transcript.result}\n</tool_response>" in text
        assert ids[-1] == renderer.turn_end_id and mask[-1] == 1  # the model ends its turn itself
    assert same_as_problem <= 3  # by chance only (about 1 in 60 with +- up to 9)


async def test_calculator_agent_warmup_with_question_operands_calls_its_numbers_with_a_random_operation(
    renderer: ChatRenderer,
) -> None:
    warmup = example("warmup")
    settings = problems.ProblemSettings(ops="+-*", max_number=7, max_second=2)
    operations = []
    for seed in range(1, 41):  # the draws have seeds of their own (make_problem draws its operation from the seed)
        problem = problems.make_problem(seed, settings)
        transcript = warmup.draw(problem, random.Random(seed + 10_000), settings, operands="question")
        a, op, b = transcript.expression.split()
        assert (int(a), int(b)) == problem.numbers  # the question's numbers, in its order
        # The operation is the same draw whatever the problem asks: nothing of the question's words in it.
        other = warmup.draw(
            problems.make_problem(seed + 1000, settings), random.Random(seed + 10_000), settings, operands="question"
        )
        assert other.expression.split()[1] == op
        operations.append((op, problem.expression.split()[1]))
        ids, mask = await warmup.render(transcript, renderer)
        call, final = assistant_text(renderer, ids, mask)
        _, (parsed,) = parse_tool_calls(call, allowed={"calculator"})
        assert parsed.arguments == {"expression": transcript.expression} and final == transcript.result
    assert {op for op, _ in operations} == set(settings.ops)
    assert sum(op == asked for op, asked in operations) < 25  # right by chance only (about 1 in 3)


async def test_calculator_agent_warmup_with_a_call_fraction_answers_at_once_in_the_other_transcripts(
    renderer: ChatRenderer,
) -> None:
    warmup = example("warmup")
    settings = problems.ProblemSettings(ops="*", max_number=9, max_second=3)
    calls = 0
    for seed in range(60):
        problem = problems.make_problem(seed, settings)
        transcript = warmup.draw(problem, random.Random(seed), settings, operands="question", call_fraction=1 / 3)
        ids, mask = await warmup.render(transcript, renderer)
        replies = assistant_text(renderer, ids, mask)
        if transcript.expression is None:  # one reply, a bare number that is no call: a guess
            (final,) = replies
            assert final == transcript.answer and int(final) > 0
            assert parse_tool_calls(final, allowed={"calculator"}) == (final, [])
            assert "<tool_response>" not in renderer.decode(ids)
        else:
            calls += 1
            assert transcript.expression == problem.expression  # one operation: the question's numbers are it
            assert replies[1] == transcript.result == str(problem.answer)
        assert ids[-1] == renderer.turn_end_id and mask[-1] == 1
        # The choice is the draw's alone: another problem, the same rng, calls or answers alike.
        other_problem = problems.make_problem(seed + 1000, settings)
        other = warmup.draw(other_problem, random.Random(seed), settings, operands="question", call_fraction=1 / 3)
        assert (other.expression is None) == (transcript.expression is None)
    assert 10 <= calls <= 30  # about a third of 60
    # Each weighs 1 where it chooses: the answer's weight is for the copy after a call, not for the guess.
    batch = warmup.batch_of(40, settings, "result", 4.0, "question", call_fraction=1 / 3)
    rows = await asyncio.to_thread(batch, renderer, random.Random(0))  # it runs a loop of its own
    assert {max(weights) for _, weights in rows} == {1.0, 4.0}
    assert all(weights[-1] == (4.0 if 4.0 in weights else 1.0) for _, weights in rows)


async def test_calculator_agent_warmup_weighs_the_final_reply_alone(renderer: ChatRenderer) -> None:
    warmup = example("warmup")
    settings = problems.ProblemSettings()
    transcript = warmup.draw(problems.make_problem(3, settings), random.Random(3), settings)
    ids, mask = await warmup.render(transcript, renderer)
    weights = warmup.weigh_answer(mask, 4.0)
    assert [w == 0 for w in weights] == [m == 0 for m in mask]
    heavy = [i for i, w in enumerate(weights) if w == 4.0]
    assert renderer.decode([ids[i] for i in heavy]).startswith(transcript.answer)  # the answer and its end of turn
    assert heavy == list(range(len(ids) - len(heavy), len(ids))) and ids[-1] == renderer.turn_end_id
    assert weights.count(1.0) == sum(mask) - len(heavy) > 10  # the tool call, at 1


# -- agent.py, run as the env-host runs it ------------------------------------------------------------


async def run_agent(endpoint: AgentEndpoint, episode: AgentEpisode, seed: int, timeout: float = 60) -> tuple[int, str]:
    """Run agent.py for `episode` (opened on `endpoint`) as the env-host would: its exit status and stderr."""
    access = endpoint.open(episode)
    environ = {
        **os.environ,
        "OPENAI_BASE_URL": access.base_url,
        "OPENAI_API_KEY": access.api_key,
        "ROLLART_EPISODE_SEED": str(seed),
        "ROLLART_EPISODE_ID": episode.episode_id,
        "ROLLART_TASK": "calculator",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE / "agent.py"),
        env=environ,
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stderr.decode()


@pytest.fixture
async def endpoint() -> Any:
    served = AgentEndpoint(model_name="qwen3-bpe")
    await served.start()
    yield served
    await served.stop()


def config_task() -> TaskSpec:
    """The task of configs/agent.yaml."""
    from rollart.topology import load_topology

    rollout = load_topology(ROOT / "configs" / "agent.yaml").run.rollout
    assert rollout is not None
    (task,) = rollout.tasks
    return task


def open_episode(renderer: ChatRenderer, generate: Any, name: str = "calc1") -> AgentEpisode:
    """An episode of configs/agent.yaml's task, its turns generated by `generate`."""
    return AgentEpisode(name, task=config_task(), sampling=SamplingSpec(), renderer=renderer, generate=generate)


@pytest.mark.integration
@pytest.mark.parametrize("answer", ["result", "random"])
async def test_calculator_agent_plays_a_scripted_model_and_its_tokens_are_the_warmups(
    renderer: ChatRenderer, endpoint: AgentEndpoint, answer: str
) -> None:
    from tests.integration.test_agent_endpoint import Scripted

    warmup = example("warmup")
    settings, seed = problems.ProblemSettings(), 11
    problem = problems.make_problem(seed, settings)
    transcript = warmup.draw(problem, random.Random(5), settings, answer)
    scripted = Scripted(renderer, *transcript.replies)
    episode = open_episode(renderer, scripted)
    code, stderr = await run_agent(endpoint, episode, seed)
    assert code == 0, stderr
    right = float(transcript.answer) == problem.answer  # the call is evaluated: the answer counts
    assert episode.report is not None
    assert (episode.report.reward, episode.report.success) == (float(right), right)
    assert episode.report.answer == transcript.answer
    assert episode.turns == 2 and episode.history.segments == []  # one sequence: the tool result continued it
    # The warm-up renders exactly what the endpoint recorded of agent.py's episode.
    ids, mask = await warmup.render(transcript, renderer)
    assert ids == (episode.prompt_ids or []) + episode.history.ids
    assert mask == [0] * len(episode.prompt_ids or []) + episode.history.mask


@pytest.mark.integration
async def test_calculator_agent_solves_with_the_calculator_and_shows_a_broken_call_its_error(
    renderer: ChatRenderer, endpoint: AgentEndpoint
) -> None:
    from tests.integration.test_agent_endpoint import Scripted

    warmup = example("warmup")
    problem = problems.make_problem(3)
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}\n</tool_call>'
    scripted = Scripted(renderer, broken, warmup.tool_call_text(problem.expression), f"It is {problem.answer}.")
    episode = open_episode(renderer, scripted)
    code, stderr = await run_agent(endpoint, episode, 3)
    assert code == 0, stderr
    assert episode.report is not None and (episode.report.reward, episode.report.success) == (1.0, True)
    assert episode.report.answer == str(problem.answer)
    assert episode.turns == 3 and episode.history.segments == []
    text = renderer.decode(episode.history.ids)
    assert "Error: the model's tool call cannot be used: tool call 1 is not JSON" in text
    assert f"<tool_response>\n{problem.answer}\n</tool_response>" in text


@pytest.mark.integration
async def test_calculator_agent_scores_nothing_for_a_right_guess_without_the_calculator(
    renderer: ChatRenderer, endpoint: AgentEndpoint
) -> None:
    """A broken call, its error, then the right number: right, but not solved with the tool."""
    from tests.integration.test_agent_endpoint import Scripted

    problem = problems.make_problem(3)
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}\n</tool_call>'
    episode = open_episode(renderer, Scripted(renderer, broken, str(problem.answer)))
    code, stderr = await run_agent(endpoint, episode, 3)
    assert code == 0, stderr
    assert episode.report is not None and (episode.report.reward, episode.report.success) == (0.0, False)
    assert episode.report.answer == str(problem.answer) and episode.turns == 2


def test_calculator_problems_with_a_small_second_number() -> None:
    settings = problems.ProblemSettings(max_number=7, max_second=2)
    assert settings == problems.ProblemSettings.from_environ(
        {"CALCULATOR_MAX_NUMBER": "7", "CALCULATOR_MAX_SECOND": "2"}
    )
    drawn = [problems.make_problem(seed, settings).numbers for seed in range(400)]
    assert {a for a, _ in drawn} == set(range(1, 8)) and {b for _, b in drawn} == {1, 2}
    # Unset, the second is drawn as the first: the same problems as before the setting existed.
    assert problems.make_problem(5) == problems.make_problem(5, problems.ProblemSettings(max_second=3))
    with pytest.raises(ValueError, match="max_second"):
        problems.ProblemSettings(max_second=0)


@pytest.mark.integration
async def test_calculator_agent_exits_quietly_when_its_episode_is_closed(
    renderer: ChatRenderer, endpoint: AgentEndpoint
) -> None:
    async def closes(request: Any) -> Any:
        endpoint.close(request.trajectory_id, "too stale: version 3 is past the staleness bound")
        await asyncio.Event().wait()  # cancelled by the close

    episode = open_episode(renderer, closes)
    code, stderr = await run_agent(endpoint, episode, 0)
    assert code == 2 and "too stale" in stderr and "Traceback" not in stderr, stderr


@pytest.mark.integration
async def test_calculator_agent_episode_with_the_real_engine_reports_a_reward(
    qwen3_bpe_dir: Path, renderer: ChatRenderer, endpoint: AgentEndpoint
) -> None:
    import torch

    from rollart.generation.hf.engine import HFEngine
    from rollart.models.checkpoint import engine_dtype
    from tests.integration.test_agent_endpoint import EngineGenerator

    torch.manual_seed(0)
    dtype = getattr(torch, engine_dtype("auto", qwen3_bpe_dir, on_gpu=False))
    engine = HFEngine(qwen3_bpe_dir, max_batch_size=1, dtype=dtype)
    await engine.start()
    try:
        generator = EngineGenerator(engine)
        episode = open_episode(renderer, generator)
        code, stderr = await run_agent(endpoint, episode, 5, timeout=120)
    finally:
        await engine.close()
    assert code == 0, stderr
    # A model with random weights: whatever it said, the agent played on and reported (wrong, most likely).
    assert episode.report is not None and episode.report.reward in (0.0, 1.0)
    assert 1 <= episode.turns <= 4 and len(generator.results) == episode.turns
    generated = [t for t, m in zip(episode.history.ids, episode.history.mask, strict=True) if m]
    assert generated == [t for result in generator.results for t in result.token_ids]


def test_calculator_agent_warmup_cli_trains_the_model_in_place_and_records_what_it_taught(
    qwen3_bpe_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    import shutil

    from safetensors.torch import load_file

    warmup = example("warmup")
    model = shutil.copytree(qwen3_bpe_dir, tmp_path / "model")
    before = load_file(model / "model.safetensors")
    assert warmup.main([str(model), "--steps", "2", "--transcripts", "2", "--answer", "random", "--ops", "+"]) == 0
    after = load_file(model / "model.safetensors")
    assert any(not before[name].float().equal(after[name].float()) for name in before)
    marker = json.loads((model / "rollart-model.json").read_text())
    assert marker["kind"] == "rollart-qwen3-bpe"  # what the build wrote is kept
    taught = marker["format_warmup"]
    assert (taught["steps"], taught["transcripts_per_step"], taught["policy"]) == (2, 2, warmup.POLICY)
    assert (taught["answer"], taught["ops"], taught["max_number"]) == ("random", "+", 3)
    assert warmup.main([str(model), "--steps", "1", "--transcripts", "2", "--ops", "+", "--call-fraction", "0.5"]) == 0
    again = json.loads((model / "rollart-model.json").read_text())["format_warmup"]
    assert again["steps"] == 1 and again["earlier"] == [taught]  # a second warm-up keeps the first on record
    assert 0 < taught["final_loss"] < 20 and "never which operation" in taught["what"]
    assert taught["call_fraction"] == 1.0 and again["call_fraction"] == 0.5 and "50% of them answer" in again["what"]
    with pytest.raises(SystemExit):
        warmup.main([str(model), "--steps", "1", "--call-fraction", "0"])
