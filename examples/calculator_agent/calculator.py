"""The calculator tool of the calculator agent: its OpenAI declaration and a safe evaluator.

    python examples/calculator_agent/calculator.py "3 + 4 * 2"      # prints 11

`calculate` reads an expression of numbers, `+ - * /` and parentheses with `ast` (never `eval`): a name, a
call, an attribute, a power, a string or anything else is refused, and so are an expression longer than
`MAX_CHARS` and a value past `MAX_MAGNITUDE` (so that no input makes it compute for long). `result_text` is
what the tool answers the model with: the value as a short number (`7`, `2.5`), or `error: ...`.
"""

from __future__ import annotations

import ast
import operator
import sys
from collections.abc import Callable
from typing import Any

NAME = "calculator"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": "Evaluate arithmetic: numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""As the agent passes it in `tools` (the chat template shows it to the model, word for word)."""

MAX_CHARS = 200
MAX_MAGNITUDE = 1e15
_OPERATORS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def calculate(expression: str) -> float:
    """The value of `expression` (numbers, `+ - * /`, unary minus, parentheses); `CalculatorError` otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc
    return _value(tree.body)


def _value(node: ast.expr) -> float:
    if isinstance(node, ast.Constant):
        # bool is an int to Python, and not a number here
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"not a number: {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    raise CalculatorError(f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}")


def _bounded(value: float) -> float:
    if not abs(value) <= MAX_MAGNITUDE:  # also catches nan and inf
        raise CalculatorError(f"a value past {MAX_MAGNITUDE:g}")
    return value


def number_text(value: float) -> str:
    """A number as the tool and the answers write it: `7`, `-3`, `2.5`, `0.333333`."""
    rounded = round(value, 6)
    if rounded == int(rounded):
        return str(int(rounded))
    return f"{rounded:.6f}".rstrip("0")


def result_text(arguments: object) -> str:
    """What the tool answers a call with `arguments` (`{"expression": "3 + 4"}`): the value, or `error: ...`."""
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return 'error: expected {"expression": "..."}'
    try:
        return number_text(calculate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


if __name__ == "__main__":
    print(result_text({"expression": " ".join(sys.argv[1:])}))
