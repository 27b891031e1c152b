"""What a trained model does on each FrozenLake board: its next-token distribution over U, D, L, R.

    .venv/bin/python benchmarks/lake_policy.py runs/local/checkpoints/step-000080 [MODEL_DIR ...]

For each model folder (a checkpoint or `runs/models/...`), every board the player can reach
without falling in a hole (found by walking the classic map from the start) is rendered as the
default run's `lake` task renders it (`configs/local.yaml`, `context: last`) and scored once;
prints the probability of each move and of any other token. A model that reads the board gives
different distributions on different boards; one that does not gives the same one everywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rollart.envs import make_env
from rollart.models.loading import load_model_and_tokenizer
from rollart.rollout.render import ChatRenderer
from rollart.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent


def reachable_boards(task: object, depth: int = 7) -> dict[str, str]:
    """{observation: the moves that reach it} for every board reached in up to `depth` moves."""
    seen: dict[str, str] = {}
    frontier = [""]
    for _ in range(depth):
        following = []
        for moves in frontier:
            env = make_env(task.env, **task.env_kwargs)  # type: ignore[attr-defined]
            observation, _ = env.reset(0)
            ended = False
            for move in moves:
                observation, _, terminated, truncated, _ = env.step(move)
                ended = terminated or truncated
                if ended:
                    break
            if ended or observation in seen:
                continue
            seen[observation] = moves
            following += [moves + move for move in "UDLR"]
        frontier = following
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--topology", type=Path, default=ROOT / "configs" / "local.yaml")
    args = parser.parse_args()
    rollout = load_topology(args.topology).run.rollout
    tasks = [task for task in rollout.tasks if task.name == "lake"] if rollout else []
    if not tasks:
        sys.exit(f"{args.topology}: no task named lake")
    task = tasks[0]
    boards = reachable_boards(task)
    for folder in args.models:
        model, tokenizer = load_model_and_tokenizer(folder)
        renderer = ChatRenderer(tokenizer)  # type: ignore[arg-type]
        system = task.system_for(make_env(task.env, **task.env_kwargs).system_prompt)
        letters = {move: tokenizer.convert_tokens_to_ids(move) for move in "UDLR"}
        print(f"{folder}\n  {'moves':<8}{'board':<22}" + "".join(f"{m:>6}" for m in "UDLR") + "  other")
        for board, moves in boards.items():
            _, ids = renderer.first_prompt(system, board)
            with torch.no_grad():
                probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            shown = [float(probs[i]) for i in letters.values()]
            row = "".join(f"{p:6.2f}" for p in shown)
            print(f"  {moves or '-':<8}{board.replace(chr(10), '/'):<22}{row}  {1 - sum(shown):.2f}")


if __name__ == "__main__":
    main()
