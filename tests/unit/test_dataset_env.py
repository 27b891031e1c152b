"""`env: dataset`: a local JSONL or Parquet file, read through `datasets`, one row per episode.

Files are written into `tmp_path` by the tests (Parquet with `datasets` itself), except the shipped
`examples/datasets/arithmetic.jsonl`, which is checked against its generator.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollart.envexec import EnvWorkerPool
from rollart.envs import make_env
from rollart.errors import ConfigError
from rollart.tasks import DatasetEnv
from rollart.tasks import dataset as dataset_module
from rollart.tasks.dataset import held_out, quick_match
from rollart.topology import load_topology
from tests.support import ROOT

SHIPPED = ROOT / "examples" / "datasets" / "arithmetic.jsonl"
ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(40)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset(path: Path, **kwargs: Any) -> DatasetEnv:
    env = make_env("dataset", path=str(path), **kwargs)
    assert isinstance(env, DatasetEnv)
    return env


def rows_of(env: DatasetEnv) -> list[int]:
    """The file rows of the env's split, by walking it: consecutive seeds take each row once."""
    return [env.reset(seed)[1]["row"] for seed in range(len(env))]


def test_dataset_env_plays_a_jsonl_row_one_turn_with_the_answer_in_info(tmp_path: Path) -> None:
    env = dataset(write_jsonl(tmp_path / "p.jsonl", ROWS), heldout_fraction=0.0)
    assert (env.profile, env.max_turns, len(env)) == ("decode-heavy", 1, 40)
    obs, info = env.reset(seed=7)
    row = info["row"]
    assert obs == f"What is {row} + {row}?" and info == {"seed": 7, "row": row, "split": "train"}
    result = env.step(f"It is \\boxed{{{2 * row}}}.")
    assert result == (
        f"The answer is {2 * row}.",
        1.0,
        True,
        False,
        {"answer": str(2 * row), "success": True, "boxed": True, "row": row, "turn": 1},
    )
    with pytest.raises(RuntimeError, match="no episode running"):
        env.step("again")
    env.reset(seed=7)
    _, reward, terminated, _, info = env.step(f"\\boxed{{{2 * row + 1}}}")
    assert (reward, terminated, info["success"], info["answer"]) == (0.0, True, False, str(2 * row))


def test_dataset_env_reads_parquet_with_numbers_as_answers(tmp_path: Path) -> None:
    import datasets  # type: ignore[import-untyped]

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"problem": f"{i} * 3", "solution": i * 3} for i in range(10)]).to_parquet(str(path))
    env = dataset(path, prompt_field="problem", answer_field="solution", heldout_fraction=0.0)
    obs, info = env.reset(seed=3)
    assert obs == f"{info['row']} * 3"
    _, reward, _, _, info = env.step(str(info["row"] * 3))  # no box: the whole reply is the answer
    assert (reward, info["answer"], info["boxed"]) == (1.0, str(int(info["answer"])), False)


def test_dataset_env_renders_a_template_over_the_row_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{**row, "tags": {"topic": "sums"}} for row in ROWS])
    env = dataset(path, template="Solve ({tags[topic]}, level {level}): {question}", heldout_fraction=0.0)
    obs, info = env.reset(seed=0)
    row = info["row"]
    assert obs == f"Solve (sums, level {row % 3}): What is {row} + {row}?"


def test_dataset_env_same_seed_same_row_and_consecutive_seeds_walk_the_split(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    env, again = dataset(path), dataset(path)
    for seed in (0, 1, 12345, 2**62):
        assert env.reset(seed) == again.reset(seed)
    walk = rows_of(env)
    assert sorted(walk) == sorted(set(walk)) and walk != sorted(walk)  # each row once, shuffled
    assert [env.reset(len(env) + seed)[1]["row"] for seed in range(3)] == walk[:3]  # then again, in the same order


def test_dataset_env_train_and_heldout_never_overlap_and_cover_the_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": str(i), "answer": str(i)} for i in range(1000)])
    train, heldout = (set(rows_of(dataset(path, prompt_field="q", split=split))) for split in ("train", "heldout"))
    assert not train & heldout and train | heldout == set(range(1000))
    assert 70 <= len(heldout) <= 130  # each row held out with probability 0.1
    assert heldout == {i for i in range(1000) if held_out(i, 0) < 0.1}
    exact = set(rows_of(dataset(path, prompt_field="q", split="heldout", heldout_size=25)))
    assert len(exact) == 25 and len(dataset(path, prompt_field="q", heldout_size=25)) == 975
    assert exact == set(sorted(range(1000), key=lambda i: held_out(i, 0))[:25])
    reseeded = set(rows_of(dataset(path, prompt_field="q", split="heldout", split_seed=1)))
    assert reseeded != heldout


def test_dataset_env_split_of_the_shipped_file_is_golden() -> None:
    # A hash of the row index and split_seed (blake2b, not `hash()`): the same in every process and
    # on every host. These values pin it: a change moves rows between train and held-out.
    assert [round(held_out(i, 0), 6) for i in range(3)] == [0.833689, 0.945917, 0.809932]
    heldout = dataset(SHIPPED, split="heldout")
    assert len(heldout) == 102 and len(dataset(SHIPPED)) == 898
    assert sorted(rows_of(heldout))[:5] == [3, 7, 18, 23, 24]
    assert heldout.reset(0)[0] == "Noor has 5 coins and gets 1 more. How many coins does Noor have now?"


def test_dataset_env_quick_check_takes_the_same_answer_in_other_words() -> None:
    for given in ("12", " 12 ", "$12$", "12.", "12.0", "24/2"):
        assert quick_match(given, "12"), given
    assert quick_match("0.5", "1/2") and quick_match("-3", "-3")
    for given in ("13", "", "twelve", "1/0", "12 apples"):
        assert not quick_match(given, "12"), given


def test_dataset_env_random_replies_are_answers_of_its_split(tmp_path: Path) -> None:
    env = dataset(write_jsonl(tmp_path / "p.jsonl", ROWS), heldout_fraction=0.0)
    rng = random.Random(0)
    assert env.sample_action(rng) is None  # no episode yet
    env.reset(seed=1)
    replies = {env.sample_action(rng) for _ in range(50)}
    assert replies <= {row["answer"] for row in ROWS} and len(replies) > 10


def test_dataset_env_reads_the_file_once_per_process_and_again_when_it_changes(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    first = dataset(path, heldout_fraction=0.0)
    table = dataset_module._files[path].rows
    dataset(path, heldout_fraction=0.0)
    assert dataset_module._files[path].rows is table  # not read again
    write_jsonl(path, [{"question": "What is 1 + 1?", "answer": "2"}])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later mtime even on a coarse clock
    changed = dataset(path, heldout_fraction=0.0)
    assert len(changed) == 1 and changed.reset(5)[0] == "What is 1 + 1?"
    assert len(first) == 40  # an env made before keeps the rows it was made with


def bad_rows(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "bad.jsonl", [*ROWS[:3], {"question": "What is 9?"}, {**ROWS[4], "answer": " "}])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: {"path": str(p.parent / "nope.jsonl")}, r"cannot read '.*nope\.jsonl' \(at .*\): No such file"),
        (lambda p: {"path": "nope.jsonl"}, r"relative path is taken from the working directory"),
        (lambda p: {"path": str(p), "answer_field": "answr"}, r"answer_field 'answr' is not a field.*'answer'\?"),
        (lambda p: {"path": str(p), "prompt_field": "q"}, r"prompt_field 'q' is not a field.*question, answer, level"),
        (lambda p: {"path": str(p), "template": "Q: {questoin}"}, r"template field 'questoin'.*'question'\?"),
        (lambda p: {"path": str(p), "template": "Q: {}"}, r"name each field"),
        (lambda p: {"path": str(p), "template": "Q: {question"}, r"not a str.format template"),
        (lambda p: {"path": str(p), "template": "{question}", "prompt_field": "question"}, r"not both"),
        (lambda p: {"path": str(p), "split": "heldout", "heldout_fraction": 0.0}, r"'heldout' split .* is empty"),
        (lambda p: {"path": str(p), "heldout_size": 40}, r"'train' split .* is empty \(40 rows, heldout_size=40"),
        (lambda p: {"path": str(p), "heldout_fraction": 1.0}, r"0 <= heldout_fraction < 1"),
        (lambda p: {"path": str(p), "split": "test"}, r"split must be 'train' or 'heldout'"),
        (lambda p: {"path": str(p), "shuffle": True}, r"unexpected keyword argument 'shuffle'; it accepts: path,"),
        (
            lambda p: {"path": str(bad_rows(p.parent))},
            r"2 of 5 rows of .*bad\.jsonl have no 'answer' \(the first: row 3",
        ),
        (lambda p: {"path": str(p.with_suffix(".csv"))}, r"expected a file ending in \.jsonl, \.json, \.parquet"),
    ],
)
def test_dataset_env_refuses_bad_arguments_and_files_with_a_config_error(
    tmp_path: Path, make: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    path.with_suffix(".csv").write_text("question,answer\n")
    monkeypatch.chdir(tmp_path / "..")
    with pytest.raises(ConfigError, match=rf"^env 'dataset': .*{message}"):
        make_env("dataset", **make(path))


def test_dataset_env_refuses_a_file_that_is_not_what_its_name_says(tmp_path: Path) -> None:
    (tmp_path / "broken.jsonl").write_text('{"question": "1 + 1", "answer": "2"}\n{"question": \n')
    with pytest.raises(ConfigError, match=r"cannot read .*broken\.jsonl as json: "):
        make_env("dataset", path=str(tmp_path / "broken.jsonl"))
    (tmp_path / "empty.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=r"cannot read .*empty\.parquet as parquet: "):
        make_env("dataset", path=str(tmp_path / "empty.parquet"))


def test_dataset_env_shipped_arithmetic_file_is_what_its_generator_writes() -> None:
    generator = runpy.run_path(str(SHIPPED.parent / "make_arithmetic.py"))
    rows = generator["make_rows"]()
    assert generator["to_jsonl"](rows) == SHIPPED.read_text()
    assert len(rows) == 1000 and len({row["question"] for row in rows}) == 1000
    assert {row["kind"] for row in rows} == {"add", "sub", "word"}
    assert all(0 <= int(row["answer"]) <= 10 for row in rows)
    assert SHIPPED.stat().st_size < 200_000 and SHIPPED.read_text().isascii()


def test_dataset_env_topology_example_loads_and_its_task_plays(monkeypatch: pytest.MonkeyPatch) -> None:
    topology = load_topology(ROOT / "configs" / "dataset.yaml")
    assert topology.run.rollout is not None
    (task,) = topology.run.rollout.tasks
    assert (task.env, task.reward) == ("dataset", "math_verify")
    monkeypatch.chdir(ROOT)  # the file's path is relative to the working directory, as a node's
    env = make_env(task.env, **task.env_kwargs)
    obs, info = env.reset(seed=0)
    assert obs == "Ivo has 5 books and gives away 5. How many books does Ivo have now?" and info["split"] == "train"
    assert env.step("0")[1] == 1.0


def test_dataset_env_importing_envs_and_the_topology_imports_neither_datasets_nor_math_verify() -> None:
    script = (
        "import sys\n"
        "import rollart.envs, rollart.rewards, rollart.topology\n"
        "print(sorted(m for m in ('datasets', 'pyarrow', 'math_verify', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


async def test_dataset_env_runs_in_an_env_worker_process_under_its_limits() -> None:
    # A worker is a fresh interpreter under the default 4 GiB of address space: `datasets` and pyarrow fit.
    async with EnvWorkerPool(processes=1) as pool:
        runner = await pool.open("dataset", {"path": str(SHIPPED), "split": "heldout"}, timeout_s=60)
        obs, info = await runner.reset(0)
        assert (obs, info["row"]) == (dataset(SHIPPED, split="heldout").reset(0)[0], 222)
        *_, info = await runner.step("\\boxed{6}")
        assert info["success"] is True and runner.pid != os.getpid()
        await runner.close()
