"""Tests of `rollart.envs`: the built-in envs (deterministic, solvable, format penalties), the
registry and user env modules, the flaky env, the adapters (with hand-written fake `gem` and
`gymnasium` modules; the real Gymnasium only where installed), and `EnvRunner`'s containment of
exceptions and hangs.

The solvers here read only the observation text, so they also check that it says enough.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import sys
import threading
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from rollart.envexec import EnvRunner
from rollart.envs import (
    DIRECTIONS,
    FORMAT_PENALTY,
    Env,
    EnvFailure,
    Info,
    StepResult,
    import_env_modules,
    last_boxed,
    make_env,
    parse_choice,
    register_env,
    registered_envs,
)
from rollart.envs import registry as registry_module
from rollart.errors import ConfigError
from rollart.tasks import position_match

Pos = tuple[int, int]


def board(obs: str, cells: str) -> list[str]:
    """The rows of the board in an observation: the lines made only of `cells` characters."""
    return [line for line in obs.splitlines() if line and all(ch in cells for ch in line)]


def find(rows: list[str], chars: str) -> Pos:
    return next((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch in chars)


def move(pos: Pos, direction: str) -> Pos:
    return pos[0] + DIRECTIONS[direction][0], pos[1] + DIRECTIONS[direction][1]


def bfs(start: Any, neighbours: Any, done: Any) -> list[str] | None:
    """Shortest move list from `start` to a state where `done(state)`; `neighbours(state)`
    yields (move, next state)."""
    seen: dict[Any, tuple[Any, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if done(state):
            moves = []
            while (back := seen[state]) is not None:
                state, step = back
                moves.append(step)
            return moves[::-1]
        for step, nxt in neighbours(state):
            if nxt not in seen:
                seen[nxt] = (state, step)
                queue.append(nxt)
    return None


def solve_frozen_lake(obs: str) -> list[str] | None:
    rows = board(obs, "SFHGP")
    size = len(rows)

    def neighbours(pos: Pos) -> Iterator[tuple[str, Pos]]:
        for d in DIRECTIONS:
            r, c = move(pos, d)
            if 0 <= r < size and 0 <= c < size and rows[r][c] != "H":
                yield d, (r, c)

    return bfs(find(rows, "P"), neighbours, lambda p: rows[p[0]][p[1]] == "G")


def solve_sokoban(obs: str) -> list[str] | None:
    rows = board(obs, "#_$.@*+")

    def neighbours(state: tuple[Pos, Pos]) -> Iterator[tuple[str, tuple[Pos, Pos]]]:
        player, box = state
        for d in DIRECTIONS:
            nxt = move(player, d)
            if rows[nxt[0]][nxt[1]] == "#":
                continue
            if nxt != box:
                yield d, (nxt, box)
            elif rows[(beyond := move(box, d))[0]][beyond[1]] != "#":
                yield d, (nxt, beyond)

    target = find(rows, ".*+")
    return bfs((find(rows, "@+"), find(rows, "$*")), neighbours, lambda s: s[1] == target)


# --- built-ins ------------------------------------------------------------------------------


def test_builtins_are_registered() -> None:
    assert {"frozen-lake", "sokoban", "copy-reverse", "flaky"} <= set(registered_envs())
    assert make_env("frozen-lake").profile == "prefill-heavy"
    assert make_env("sokoban").profile == "prefill-heavy"
    assert make_env("copy-reverse").profile == "decode-heavy"
    assert all("\\boxed{" in make_env(n).system_prompt for n in ("frozen-lake", "sokoban", "copy-reverse"))


@pytest.mark.parametrize("name", ["frozen-lake", "sokoban", "copy-reverse"])
def test_same_seed_same_episode(name: str) -> None:
    a, b = make_env(name), make_env(name)
    assert a.reset(seed=7) == b.reset(seed=7)
    for action in ["\\boxed{up}", "left", "\\boxed{RIGHT}", "nonsense"][: a.max_turns]:
        assert a.step(action) == b.step(action)
    assert len({make_env(name).reset(seed=s)[0] for s in range(20)}) >= 15
    obs, info = make_env(name).reset()
    assert isinstance(info["seed"], int)
    assert make_env(name).reset(seed=info["seed"])[0] == obs


@pytest.mark.parametrize("seed", range(60))
def test_frozen_lake_is_solvable_by_reading_the_board(seed: int) -> None:
    env = make_env("frozen-lake")
    obs, _ = env.reset(seed=seed)
    path = solve_frozen_lake(obs)
    assert path is not None and len(path) <= env.max_turns
    for i, direction in enumerate(path):
        obs, reward, terminated, truncated, info = env.step(f"I go {direction}. \\boxed{{{direction}}}")
        last = i == len(path) - 1
        assert (reward, terminated, truncated, info["success"]) == (
            (1.0, True, False, True) if last else (0.0, False, False, False)
        )
    assert "P" in board(obs, "SFHGP")[-1] or "reached the goal" in obs


def test_frozen_lake_larger_and_with_many_holes_stays_solvable() -> None:
    env = make_env("frozen-lake", size=6, hole_prob=0.6, max_turns=12)
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        assert len(board(obs, "SFHGP")) == 6
        path = solve_frozen_lake(obs)
        assert path is not None and len(path) <= 12


def test_frozen_lake_hole_terminates_and_edge_keeps_place() -> None:
    env = make_env("frozen-lake", hole_prob=0.4)
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        rows = board(obs, "SFHGP")
        player = find(rows, "P")
        into_hole = [
            d for d in DIRECTIONS if 0 <= (p := move(player, d))[0] < 4 and 0 <= p[1] < 4 and rows[p[0]][p[1]] == "H"
        ]
        off_edge = [d for d in DIRECTIONS if not (0 <= (p := move(player, d))[0] < 4 and 0 <= p[1] < 4)]
        if into_hole and off_edge:
            break
    else:
        pytest.fail("no seed put the player beside both a hole and the edge")
    obs, reward, terminated, _, _ = env.step(f"\\boxed{{{off_edge[0]}}}")
    assert (reward, terminated) == (0.0, False) and board(obs, "SFHGP") == rows and "edge" in obs
    obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{into_hole[0]}}}")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert "hole" in obs
    with pytest.raises(RuntimeError, match=r"no episode running"):
        env.step("\\boxed{up}")


@pytest.mark.parametrize("seed", range(40))
def test_sokoban_is_solvable_by_reading_the_board(seed: int) -> None:
    env = make_env("sokoban")
    obs, _ = env.reset(seed=seed)
    rows = board(obs, "#_$.@*+")
    assert len(rows) == 6 and rows[0] == "######" and not any("*" in row for row in rows)
    assert sum(row.count("$") for row in rows) == 1 and sum(row.count(".") + row.count("+") for row in rows) == 1
    path = solve_sokoban(obs)
    assert path is not None and 1 <= len(path) <= env.max_turns
    for i, direction in enumerate(path):
        obs, reward, terminated, _, info = env.step(f"\\boxed{{{direction}}}")
        assert (reward, terminated) == ((1.0, True) if i == len(path) - 1 else (0.0, False))
    assert info["success"] and "*" in "".join(board(obs, "#_$.@*+"))


def test_sokoban_truncates_at_max_turns_with_step_penalty() -> None:
    env = make_env("sokoban", max_turns=4, step_penalty=0.05)
    env.reset(seed=3)
    results = [env.step("\\boxed{up}") for _ in range(4)]
    assert [r[3] for r in results] == [False, False, False, True]
    assert all(r[1] in (-0.05, 1.0) for r in results)
    assert "episode is over" in results[-1][0]


@pytest.mark.parametrize("name", ["frozen-lake", "sokoban"])
def test_grid_format_penalty_keeps_the_board_and_counts_turns(name: str) -> None:
    env = make_env(name)
    obs, _ = env.reset(seed=11)
    cells = "SFHGP" if name == "frozen-lake" else "#_$.@*+"
    for turn in range(1, env.max_turns + 1):
        new_obs, reward, terminated, truncated, info = env.step("I am not sure what to do, maybe \\boxed{north}")
        assert reward == FORMAT_PENALTY and info["format_error"] and not terminated
        assert board(new_obs, cells) == board(obs, cells)
        assert truncated == (turn == env.max_turns)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("\\boxed{up}", "up"),
        ("Thinking... \\boxed{ LEFT }", "left"),
        ("\\boxed{down} no wait \\boxed{right}", "right"),
        ("Right.", "right"),
        ("I should go down", "down"),
        ("up or down?", None),
        ("\\boxed{north} but also up", None),
        ("upward", None),
        ("", None),
    ],
)
def test_parse_choice(reply: str, expected: str | None) -> None:
    assert parse_choice(reply, DIRECTIONS) == expected


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("a \\boxed{x} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{left} then \\boxed{up", "left"),  # the case envs and rewards disagreed on
        ("\\boxed{41} no wait, \\boxed{42}", "42"),  # the last complete box
        ("\\boxed{42} and \\boxed{\\frac{1}{2", "42"),  # an unterminated one takes nothing back
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces kept
        ("x \\boxed{a{b{c}}d} y", "a{b{c}}d"),
        ("\\boxed{a \\boxed{b} c}", "b"),  # a box inside a box is opened last
        ("\\boxed{}", ""),  # complete and empty: an answer, if not a valid one
        ("no box at all", None),
        ("\\boxed{unterminated", None),
        ("\\boxed{a{b}", None),  # its inner brace closes, the box does not
        ("boxed{x}", None),  # no backslash, no box
    ],
)
def test_last_boxed_is_the_last_complete_box_for_envs_and_rewards(text: str, expected: str | None) -> None:
    from rollart.rewards import exact_answer
    from rollart.rewards import last_boxed as rewards_last_boxed
    from rollart.rewards.base import ScoreInput

    assert last_boxed(text) == expected
    assert rewards_last_boxed is last_boxed  # one implementation, so they cannot disagree
    # What the env accepts as an action is what exact-answer grades:
    accepted = parse_choice(text, DIRECTIONS)
    scored = exact_answer(ScoreInput(task="t", prompt="", response=text, answer="reference"))
    if expected is None:
        assert accepted is None and scored.details["format_error"] is True
    else:
        assert scored.details["extracted"] == expected and "format_error" not in scored.details
        assert accepted == (expected if expected in DIRECTIONS else None)


def test_copy_reverse_rewards() -> None:
    env = make_env("copy-reverse")
    obs, info = env.reset(seed=5)
    text = re.search(r"Reverse this string: ([a-z]+)", obs)
    assert text is not None and 16 <= len(text[1]) <= 32 and set(text[1]) <= set("abcdefgh")
    answer = info["answer"]
    assert answer == text[1][::-1]
    assert env.step(f"\\boxed{{{answer}}}")[1:4] == (1.0, True, False)

    env.reset(seed=5)
    half = len(answer) // 2
    _, reward, terminated, _, step_info = env.step(f"\\boxed{{{answer[:half] + 'z' * (len(answer) - half)}}}")
    assert reward == pytest.approx(0.5, abs=0.05) and terminated and step_info["answer"] == answer

    env.reset(seed=5)
    _, reward, terminated, _, step_info = env.step(answer)
    assert (reward, terminated, step_info["format_error"]) == (FORMAT_PENALTY, True, True)


def test_position_match() -> None:
    assert position_match("cba", "cba") == 1.0
    assert position_match("cbaxxx", "cba") == 0.5  # padding does not pay
    assert position_match("", "cba") == 0.0
    assert position_match("cxa", "cba") == pytest.approx(2 / 3)


def test_copy_reverse_configuration() -> None:
    env = make_env("copy-reverse", min_len=3, max_len=3, alphabet="ab")
    _, info = env.reset(seed=0)
    assert len(info["answer"]) == 3 and set(info["answer"]) <= {"a", "b"}
    with pytest.raises(ConfigError, match=r"min_len"):
        make_env("copy-reverse", min_len=10, max_len=5)


# --- registry -------------------------------------------------------------------------------


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by the test are undone afterwards."""
    monkeypatch.setattr(registry_module, "_envs", dict(registry_module._envs))


def test_unknown_env_suggests_a_close_name() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'frozen-lake'") as caught:
        make_env("frozen-lak")
    assert "copy-reverse" in str(caught.value) and "gym:<id>" in str(caught.value)


def test_bad_keyword_and_bad_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"frozen-lake.*sise.*accepts: size, hole_prob"):
        make_env("frozen-lake", sise=5)
    with pytest.raises(ConfigError, match=r"too few to cross"):
        make_env("frozen-lake", size=8)
    with pytest.raises(ConfigError, match=r"hole_prob"):
        make_env("frozen-lake", hole_prob=1.0)
    with pytest.raises(ConfigError, match=r"size must be >= 5"):
        make_env("sokoban", size=4)


def test_the_grid_options_every_grid_game_shares_are_checked_by_name() -> None:
    # FrozenLake and Sokoban take them as **grid: Unpack[GridOptions]; a typo is still refused.
    with pytest.raises(ConfigError, match=r"sokoban.*'max_turn'.*accepts: size, step_penalty, actions, .*max_turns"):
        make_env("sokoban", max_turn=5)
    lake, box = make_env("frozen-lake", actions="letters", max_turns=9), make_env("sokoban")
    assert (lake.max_turns, lake.actions, box.max_turns) == (9, "letters", 10)  # each game's own default


@pytest.mark.usefixtures("scratch_registry")
def test_register_refuses_duplicates_unless_overwrite() -> None:
    register_env("tmp-env", lambda: make_env("copy-reverse"))
    with pytest.raises(ConfigError, match=r"already registered"):
        register_env("tmp-env", lambda: make_env("sokoban"))
    register_env("tmp-env", lambda: make_env("sokoban"), overwrite=True)
    assert make_env("tmp-env").profile == "prefill-heavy"
    with pytest.raises(ConfigError, match=r"invalid"):
        register_env("a:b", lambda: make_env("sokoban"))


@pytest.mark.usefixtures("scratch_registry")
def test_import_env_modules_registers_user_envs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_envs_ok.py").write_text(
        "from rollart.envs import register_env\n"
        "from rollart.tasks import CopyReverseEnv\n"
        "class Short(CopyReverseEnv):\n"
        "    pass\n"
        "register_env('short-reverse', lambda: Short(min_len=2, max_len=2))\n"
    )
    (tmp_path / "user_envs_broken.py").write_text("raise ValueError('boom at import')\n")
    monkeypatch.syspath_prepend(tmp_path)
    for name in ("user_envs_ok", "user_envs_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import_env_modules(["user_envs_ok"])
    assert "short-reverse" in registered_envs()
    assert len(make_env("short-reverse").reset(seed=1)[1]["answer"]) == 2
    with pytest.raises(ConfigError, match=r"'user_envs_broken'.*ValueError: boom at import"):
        import_env_modules(["user_envs_broken"])
    with pytest.raises(ConfigError, match=r"'no_such_pkg.envs'.*ModuleNotFoundError"):
        import_env_modules(["no_such_pkg.envs"])
    sys.modules.pop("user_envs_ok", None)


# --- flaky ----------------------------------------------------------------------------------


def test_flaky_fails_at_the_configured_rates_deterministically() -> None:
    env = make_env("flaky", inner="frozen-lake", reset_failure=0.2, step_failure=0.3, seed=5, hole_prob=0.0)
    reset_failed, step_failed, steps = [], 0, 0
    for seed in range(1000):
        try:
            env.reset(seed=seed)
        except EnvFailure:
            reset_failed.append(seed)
            continue
        steps += 1
        try:
            env.step("garbage")
        except EnvFailure:
            step_failed += 1
    assert len(reset_failed) / 1000 == pytest.approx(0.2, abs=0.04)
    assert step_failed / steps == pytest.approx(0.3, abs=0.05)
    again = make_env("flaky", inner="frozen-lake", reset_failure=0.2, seed=5, hole_prob=0.0)
    assert [s for s in range(100) if _reset_fails(again, s)] == [s for s in reset_failed if s < 100]


def test_flaky_envs_of_one_group_fail_independently() -> None:
    # Without a `seed`, each env draws its own faults: the trajectories of a group (one episode
    # seed) do not all fail together, and a group re-run after a failure can succeed.
    both = sum(
        all(_reset_fails(make_env("flaky", inner="frozen-lake", reset_failure=0.2), seed) for _ in range(2))
        for seed in range(1000)
    )
    assert both / 1000 == pytest.approx(0.2 * 0.2, abs=0.02)


def _reset_fails(env: Env, seed: int) -> bool:
    try:
        env.reset(seed=seed)
    except EnvFailure:
        return True
    return False


def test_flaky_passes_through_its_inner_env() -> None:
    env = make_env("flaky", inner="copy-reverse", reset_failure=0.0, step_failure=0.0, min_len=4, max_len=4)
    assert (env.profile, env.max_turns) == ("decode-heavy", 1)
    _, info = env.reset(seed=2)
    assert env.step(f"\\boxed{{{info['answer']}}}")[1] == 1.0
    with pytest.raises(ConfigError, match=r"reset_failure"):
        make_env("flaky", reset_failure=1.5)


# --- adapters -------------------------------------------------------------------------------


def test_adapters_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gem", None)  # makes `import gem` fail even where it is installed
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ConfigError, match=r"install the gem extra: pip install gem-llm"):
        make_env("gem:game:Sokoban-v0-easy")
    with pytest.raises(ConfigError, match=r"pip install gymnasium"):
        make_env("gym:FrozenLake-v1")
    with pytest.raises(ConfigError, match=r"give an id"):
        make_env("gym:")


class FakeGemGuess:
    """A stand-in for a GEM env: guess the number 3, in `\\boxed{}`."""

    max_turns = 4

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "Guess a number from 1 to 5.", {"seed": seed}

    def step(self, action: str) -> tuple[str, int, bool, bool, dict[str, Any]]:
        right = last_boxed(action) == "3"
        return ("Correct!" if right else "Wrong."), int(right), right, False, {}


def test_gem_adapter_with_a_fake_gem(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("gem")
    fake.make = lambda env_id, **kwargs: FakeGemGuess()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gem", fake)
    env = make_env("gem:game:GuessTheNumber-v0")
    assert (env.profile, env.max_turns) == ("prefill-heavy", 4)
    assert make_env("gem:math:Foo").profile == "decode-heavy"
    assert env.reset(seed=1) == ("Guess a number from 1 to 5.", {"seed": 1})
    result = env.step("\\boxed{3}")
    assert result == ("Correct!", 1.0, True, False, {}) and isinstance(result[1], float)


class FakeLake:
    """A stand-in for Gymnasium's FrozenLake-v1 on a 2x2 map: S F / F G, not slippery."""

    def __init__(self) -> None:
        self.action_space = types.SimpleNamespace(n=4)
        self.spec = types.SimpleNamespace(id="FrozenLake-v1", max_episode_steps=3)
        self.unwrapped = self
        self.desc = [[b"S", b"F"], [b"F", b"G"]]
        self.s = 0

    def reset(self, seed: int | None = None) -> tuple[int, dict[str, Any]]:
        self.s = 0
        return 0, {"prob": 1}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        row, col = divmod(self.s, 2)
        dr, dc = [(0, -1), (1, 0), (0, 1), (-1, 0)][action]  # left, down, right, up
        row, col = min(max(row + dr, 0), 1), min(max(col + dc, 0), 1)
        self.s = row * 2 + col
        return self.s, float(self.s == 3), self.s == 3, False, {"prob": 1}

    def close(self) -> None:
        pass


def test_gymnasium_adapter_with_a_fake_gymnasium(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("gymnasium")
    fake.make = lambda env_id, **kwargs: FakeLake()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gymnasium", fake)
    env = make_env("gym:FrozenLake-v1")
    assert env.max_turns == 3 and "\\boxed{left}" in env.system_prompt
    obs, _ = env.reset(seed=0)
    assert board(obs, "SFHGP") == ["PF", "FG"]
    obs, reward, _, _, info = env.step("hmm")
    assert (reward, info["format_error"], board(obs, "SFHGP")) == (FORMAT_PENALTY, True, ["PF", "FG"])
    obs, reward, terminated, _, _ = env.step("\\boxed{Right}")
    assert board(obs, "SFHGP") == ["SP", "FG"] and (reward, terminated) == (0.0, False)
    obs, reward, terminated, truncated, _ = env.step("\\boxed{down}")
    assert (reward, terminated, truncated) == (1.0, True, False)


def test_gymnasium_adapter_with_the_real_frozen_lake() -> None:
    pytest.importorskip("gymnasium", reason="gymnasium is optional; the fake above covers the adapter")
    env = make_env("gym:FrozenLake-v1", is_slippery=False)
    obs, _ = env.reset(seed=0)
    assert board(obs, "SFHGP") == ["PFFF", "FHFH", "FFFH", "HFFG"]
    for i, direction in enumerate(["right", "right", "down", "down", "down", "right"]):
        obs, reward, terminated, _, _ = env.step(f"\\boxed{{{direction}}}")
        assert (reward, terminated) == ((1.0, True) if i == 5 else (0.0, False))
    env.close()


# --- runner ---------------------------------------------------------------------------------


class Scripted(Env):
    """An env whose `step` does what the test says: raise, block until released, or answer."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.release = threading.Event()
        self.closed = False

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        return "start", {"seed": seed}

    def step(self, action: str) -> StepResult:
        if self.behaviour == "raise":
            raise ValueError("bad state")
        if self.behaviour == "exit":
            raise SystemExit(3)
        if self.behaviour == "timeout-error":
            raise TimeoutError("socket timed out")
        if self.behaviour == "block":
            self.release.wait(timeout=5)
        return "ok", 1.0, True, False, {}

    def close(self) -> None:
        if self.behaviour == "raise":
            raise OSError("close failed")
        self.closed = True


async def test_runner_runs_an_env_and_closes_it() -> None:
    env = Scripted("answer")
    runner = EnvRunner(env, name="scripted", timeout_s=5)
    assert await runner.reset(4) == ("start", {"seed": 4})
    assert await runner.step("x") == ("ok", 1.0, True, False, {})
    await runner.close()
    await runner.close()
    assert env.closed and runner.closed
    with pytest.raises(EnvFailure, match=r"'scripted': step\(\) refused: the runner is closed"):
        await runner.step("x")


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ("raise", "'scripted': step\\(\\) raised ValueError: bad state"),
        ("exit", "'scripted': step\\(\\) raised RuntimeError: SystemExit raised inside the env"),
        ("timeout-error", "'scripted': step\\(\\) raised TimeoutError: socket timed out"),
    ],
)
async def test_runner_turns_exceptions_into_env_failure(behaviour: str, message: str) -> None:
    runner = EnvRunner(Scripted(behaviour), name="scripted", timeout_s=5)
    with pytest.raises(EnvFailure, match=message):
        await runner.step("x")
    assert not runner.broken
    assert await runner.reset(1) == ("start", {"seed": 1})  # the env is still usable
    if behaviour == "raise":
        with pytest.raises(EnvFailure, match=r"close\(\) raised OSError"):
            await runner.close()
    else:
        await runner.close()
    assert runner.closed


async def test_runner_times_out_a_hang_and_the_loop_keeps_ticking() -> None:
    env = Scripted("block")
    runner = EnvRunner(env, name="stuck", timeout_s=0.2)
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(ticker())
            with pytest.raises(EnvFailure, match=r"'stuck': step\(\) timed out after 0.2 s"):
                await runner.step("x")
            stop.set()
        assert ticks >= 10 and runner.broken
        with pytest.raises(EnvFailure, match=r"refused: the env is broken \(step\(\) timed out"):
            await runner.reset(0)
        await runner.close()  # lets go of the stuck thread; env.close is not called
        assert not env.closed
    finally:
        env.release.set()


async def test_runner_lets_cancellation_through() -> None:
    env = Scripted("block")
    runner = EnvRunner(env, name="stuck", timeout_s=5)
    try:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(runner.step("x"))
            await asyncio.sleep(0.02)
            task.cancel()
        assert task.cancelled() and not runner.broken
    finally:
        env.release.set()
    await runner.close()
    assert env.closed


async def test_runner_times_out_a_flaky_hang() -> None:
    env = make_env("flaky", inner="copy-reverse", reset_failure=0.0, hang_prob=1.0, hang_s=0.3)
    runner = EnvRunner(env, name="flaky", timeout_s=0.05)
    with pytest.raises(EnvFailure, match=r"'flaky': reset\(\) timed out after 0.05 s"):
        await runner.reset(0)
    await runner.close()


async def test_runner_reports_injected_failures() -> None:
    runner = EnvRunner(make_env("flaky", reset_failure=1.0), name="flaky", timeout_s=5)
    with pytest.raises(EnvFailure, match=r"'flaky': reset\(\) raised EnvFailure: flaky env: injected reset"):
        await runner.reset(0)
    await runner.close()


def test_slow_env_waits_a_lognormal_time_and_passes_everything_through() -> None:
    import statistics

    from rollart.tasks import SlowEnv

    plain = make_env("copy-reverse")
    delays = []
    for seed in range(40):
        env = make_env("slow", inner="copy-reverse", median_s=0.0005, sigma=1.0, seed=seed)
        assert isinstance(env, SlowEnv)
        assert env.reset(seed) == plain.reset(seed)
        delays.append(env.waited_s)
    assert 0.0002 < statistics.median(delays) < 0.0012  # median of exp(N(0, 1)) * 0.5 ms is 0.5 ms
    assert max(delays) > 2 * statistics.median(delays)  # a tail


async def test_closing_a_runner_whose_cancelled_call_still_runs_does_not_wait_for_it() -> None:
    import time

    closed = threading.Event()

    from rollart.tasks import CopyReverseEnv

    class Sleepy(CopyReverseEnv):
        def step(self, action: str) -> Any:
            time.sleep(1.0)
            return super().step(action)

        def close(self) -> None:
            closed.set()

    runner = EnvRunner(Sleepy(), timeout_s=10)
    await runner.reset(0)
    call = asyncio.ensure_future(runner.step("\\boxed{a}"))
    await asyncio.sleep(0.05)
    call.cancel()  # a cancelled trajectory: the step goes on in its thread
    started = time.monotonic()
    await runner.close()
    assert time.monotonic() - started < 0.5  # close did not wait out the step
    assert await asyncio.to_thread(closed.wait, 3.0)  # the env is closed once the step is done


# --- one-letter actions, compact observations, fixed and corner lakes, sample_action ----------

CLASSIC = "SFFF/FHFH/FFFH/HFFG"
"""Gymnasium's classic 4x4 FrozenLake; its shortest paths take 6 moves (D D R R D R is one)."""


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("U", "up"),
        ("d", "down"),
        ("  \n L", "left"),
        ("Right, then up", "right"),  # only the first non-blank character counts
        ("x", None),
        ("", None),
        ("   \n", None),
        ("\\boxed{up}", None),
        ("1U", None),
    ],
)
def test_parse_letter(reply: str, expected: str | None) -> None:
    from rollart.tasks.grid import parse_letter

    assert parse_letter(reply) == expected


@pytest.mark.parametrize("name", ["frozen-lake", "sokoban"])
def test_letter_actions_move_and_anything_else_is_a_format_error(name: str) -> None:
    env = make_env(name, actions="letters", format_penalty=-0.5)
    assert "one letter: U (up)" in env.system_prompt and "\\boxed" not in env.system_prompt
    obs, _ = env.reset(seed=4)
    cells = "SFHGP" if name == "frozen-lake" else "#_$.@*+"
    for reply in ["Q", "\\boxed{up}", "", "north"]:
        new_obs, reward, terminated, _, info = env.step(reply)
        assert (reward, terminated, info["format_error"]) == (-0.5, False, True)
        assert board(new_obs, cells) == board(obs, cells)
        assert "U, D, L or R" in new_obs  # the feedback repeats the letter hint
    words = make_env(name)
    words.reset(seed=4)
    assert words.step("U")[4]["format_error"]  # a letter is not a move in the default word format


def test_letter_moves_are_the_same_moves_as_words() -> None:
    letters, words = make_env("frozen-lake", actions="letters"), make_env("frozen-lake")
    for seed in range(10):
        assert board(letters.reset(seed=seed)[0], "SFHGP") == board(words.reset(seed=seed)[0], "SFHGP")
        for letter, word in zip("RDLU", ["right", "down", "left", "up"], strict=True):
            a, b = letters.step(letter.lower()), words.step(f"\\boxed{{{word}}}")
            assert board(a[0], "SFHGP") == board(b[0], "SFHGP") and a[1:4] == b[1:4]
            if a[2]:
                break


@pytest.mark.parametrize(("name", "cells", "size"), [("frozen-lake", "SFHGP", 4), ("sokoban", "#_$.@*+", 6)])
def test_compact_observations_are_the_board_alone(name: str, cells: str, size: int) -> None:
    full, compact = make_env(name, actions="letters"), make_env(name, actions="letters", compact=True)
    intro = type(compact).intro  # type: ignore[attr-defined]
    assert compact.system_prompt == f"{intro}\nAnswer U, D, L or R."
    assert intro in full.reset(seed=2)[0] and intro not in full.system_prompt
    obs, _ = compact.reset(seed=2)
    assert len(obs.splitlines()) == size and board(obs, cells) == obs.splitlines()
    assert board(obs, cells) == board(full.reset(seed=2)[0], cells)
    after_error = compact.step("?")[0]
    assert after_error == obs  # no feedback line, no turn counter: the unchanged board
    for _ in range(compact.max_turns - 1):
        after, *_ = compact.step("U")
        assert board(after, cells) == after.splitlines() and "Turns" not in after


def test_compact_with_words_puts_the_boxed_hint_in_the_system_prompt() -> None:
    env = make_env("frozen-lake", compact=True)
    assert env.system_prompt.endswith("\\boxed{up}, \\boxed{down}, \\boxed{left} or \\boxed{right}.")
    assert env.system_prompt.startswith("You are on a frozen lake.")


def test_classic_layout_is_every_seeds_board_and_the_hand_path_wins() -> None:
    env = make_env("frozen-lake", layout=CLASSIC, actions="letters", compact=True)
    boards = {env.reset(seed=seed)[0] for seed in range(20)}
    assert boards == {"PFFF\nFHFH\nFFFH\nHFFG"}  # the player stands on S
    env.reset(seed=123)
    results = [env.step(letter) for letter in "DDRRDR"]
    assert [r[1:4] for r in results] == [(0.0, False, False)] * 5 + [(1.0, True, False)]
    assert results[-1][4]["success"] and results[-1][0] == "SFFF\nFHFH\nFFFH\nHFFP"
    env.reset(seed=0)
    env.step("R")
    _, reward, terminated, _, info = env.step("D")  # from (0, 1) down into the hole at (1, 1)
    assert (reward, terminated, info["success"]) == (0.0, True, False)


@pytest.mark.parametrize(
    ("layout", "max_turns", "problem"),
    [
        ("SFF/FHF", 8, r"square"),
        ("SFFF/FHFH/FFFH/HFF", 8, r"square"),
        ("S", 8, r"square"),
        ("SFFF/FXFH/FFFH/HFFG", 8, r"only use S, F, H and G, found 'X'"),
        ("FFFF/FHFH/FFFH/HFFG", 8, r"exactly one S and one G"),
        ("SFFG/FHFH/FFFH/HFFG", 8, r"exactly one S and one G"),
        ("SSFF/FHFH/FFFH/HFFG", 8, r"exactly one S and one G"),
        ("SFFF/FFFF/FFHH/FFHG", 8, r"no path from S to G"),
        ("SFFF/HHHF/FFFF/GHHH", 8, r"needs 9 moves, more than max_turns=8"),
        (CLASSIC, 5, r"needs 6 moves, more than max_turns=5"),
    ],
)
def test_bad_layouts_are_config_errors_that_name_the_problem(layout: str, max_turns: int, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"frozen-lake.*{problem}"):
        make_env("frozen-lake", layout=layout, max_turns=max_turns)


def test_a_long_layout_fits_when_max_turns_allows() -> None:
    env = make_env("frozen-lake", layout="SFFF/HHHF/FFFF/GHHH", max_turns=9, actions="letters")
    env.reset(seed=0)
    results = [env.step(letter) for letter in "RRRDDLLLD"]
    assert results[-1][1:3] == (1.0, True) and not any(r[2] for r in results[:-1])


@pytest.mark.parametrize(("size", "hole_prob", "max_turns"), [(4, 0.3, 8), (5, 0.6, 10)])
def test_corner_lakes_start_top_left_end_bottom_right_and_stay_solvable(
    size: int, hole_prob: float, max_turns: int
) -> None:
    env = make_env("frozen-lake", size=size, hole_prob=hole_prob, max_turns=max_turns, corners=True)
    holes = set()
    for seed in range(40):
        obs, _ = env.reset(seed=seed)
        rows = board(obs, "SFHGP")
        assert len(rows) == size and rows[0][0] == "P" and rows[-1][-1] == "G"
        assert sum(row.count("G") for row in rows) == 1
        path = solve_frozen_lake(obs)
        assert path is not None and len(path) <= max_turns
        holes.add(tuple(rows))
    assert len(holes) >= 20  # the holes change with the seed


def sampled_episodes(env: Any, rng: random.Random, episodes: int = 30) -> Iterator[tuple[str, str, Any]]:
    """Play `episodes` episodes (seeds 0, 1, ...) with `env.sample_action`: per step the observation
    before it, the reply and what `env.step` returned."""
    for seed in range(episodes):
        observation, _ = env.reset(seed=seed)
        done = False
        while not done:
            reply = env.sample_action(rng)
            assert reply is not None
            result = env.step(reply)
            yield observation, reply, result
            observation, done = result[0], result[2] or result[3]


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("frozen-lake", {}),
        ("frozen-lake", {"actions": "letters", "compact": True}),
        ("frozen-lake", {"layout": CLASSIC, "actions": "letters"}),
        ("sokoban", {}),
        ("sokoban", {"actions": "letters"}),
        ("copy-reverse", {}),
        ("copy-reverse", {"min_len": 2, "max_len": 5, "alphabet": "xy"}),
    ],
)
def test_sampled_actions_are_always_well_formed(name: str, kwargs: dict[str, Any]) -> None:
    env = make_env(name, **kwargs)
    replies = []
    for _, reply, (_, _, _, _, info) in sampled_episodes(env, random.Random(0)):
        replies.append(reply)
        assert not info["format_error"], reply
        if name == "copy-reverse":
            alphabet = kwargs.get("alphabet", "abcdefgh")
            content = last_boxed(replies[-1])
            assert reply == f"\\boxed{{{content}}}" and content is not None
            assert len(content) == len(info["answer"]) and set(content) <= set(alphabet)
    if kwargs.get("actions") == "letters":
        assert set(replies) == set("UDLR")
    elif name != "copy-reverse":
        assert set(replies) == {f"\\boxed{{{d}}}" for d in DIRECTIONS}
    # The same seeded rng gives the same replies.
    first, second = make_env(name, **kwargs), make_env(name, **kwargs)
    first.reset(seed=9)
    second.reset(seed=9)
    rng_a, rng_b = random.Random(42), random.Random(42)
    assert [first.sample_action(rng_a) for _ in range(5)] == [second.sample_action(rng_b) for _ in range(5)]


@pytest.mark.parametrize("name", ["frozen-lake", "sokoban"])
def test_sampled_moves_always_move(name: str) -> None:
    # The random valid policy on a grid never walks into the edge or a wall (a wasted turn), and
    # still takes every move that does move equally often: in the lake's top-left corner D and R
    # half the time each.
    env = make_env(name, actions="letters", compact=True, max_turns=40)
    rng = random.Random(0)
    for before, reply, (after, _, terminated, _, _) in sampled_episodes(env, rng):
        assert after != before or terminated, (name, reply, before)
    lake = make_env("frozen-lake", layout=CLASSIC, actions="letters", compact=True)
    lake.reset(seed=0)
    firsts = collections.Counter(lake.sample_action(rng) for _ in range(2000))
    assert set(firsts) == {"D", "R"} and abs(firsts["D"] - 1000) < 150


def test_copy_reverse_has_no_sampled_action_outside_an_episode() -> None:
    import random

    env = make_env("copy-reverse")
    assert env.sample_action(random.Random(0)) is None  # before reset: no answer length to match
    env.reset(seed=1)
    env.step("\\boxed{a}")
    assert env.sample_action(random.Random(0)) is None  # the episode is over


def test_copy_without_a_box_scores_the_whole_reply_by_position() -> None:
    env = make_env("copy-reverse", mode="copy", boxed=False, min_len=6, max_len=6, alphabet="ab")
    observation, info = env.reset(seed=7)
    text = observation.removeprefix("Copy this string: ").strip()
    assert info["answer"] == text and env.system_prompt == "" and "boxed" not in observation
    wrong_last = text[:-1] + ("a" if text[-1] == "b" else "b")
    _, reward, terminated, _, step_info = env.step(f"  {wrong_last}\n")
    assert terminated and reward == 5 / 6 and not step_info["format_error"] and not step_info["success"]
    env.reset(seed=7)
    assert env.step(text)[1] == 1.0
    env.reset(seed=7)
    guess = env.sample_action(random.Random(0))
    assert guess is not None and len(guess) == 6 and set(guess) <= {"a", "b"}


def test_repeat_asks_for_one_letter_many_times() -> None:
    env = make_env("copy-reverse", mode="repeat", boxed=False, min_len=6, max_len=6, alphabet="abcd")
    letters = set()
    for seed in range(8):
        observation, info = env.reset(seed=seed)
        letter = observation.removeprefix("Repeat this letter 6 times: ").strip()
        letters.add(letter)
        assert info["answer"] == letter * 6 and letter in "abcd"
        assert env.step(letter * 6)[1] == 1.0
        env.reset(seed=seed)
        wrong = "a" if letter != "a" else "b"
        assert env.step(wrong * 6)[1] == 0.0  # one repeated wrong letter scores below random (1/4)
    assert len(letters) > 1
    boxed = make_env("copy-reverse", mode="repeat", min_len=3, max_len=3, alphabet="abc")
    assert "\\boxed" in boxed.system_prompt and "\\boxed" in boxed.reset(seed=0)[0]
    with pytest.raises(ConfigError, match="mode must be one of reverse, copy, repeat"):
        make_env("copy-reverse", mode="sort")


@pytest.mark.parametrize("name", ["frozen-lake", "sokoban"])
def test_position_adds_the_players_cell_in_words(name: str) -> None:
    env = make_env(name, actions="letters", compact=True, position=True)
    observation, _ = env.reset(seed=3)
    *rows, where = observation.split("\n")
    row = next(r for r, line in enumerate(rows) if "P" in line or "@" in line)
    col = max(rows[row].find("P"), rows[row].find("@"))
    assert where == f"You are at row {row + 1}, column {col + 1}."
    assert make_env(name, actions="letters", compact=True).reset(seed=3)[0] == "\n".join(rows)
