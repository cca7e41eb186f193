"""The calculator tool: hand-worked arithmetic, and everything that is not arithmetic refused
with a message (never evaluated)."""

from __future__ import annotations

import pytest

from grimoire.rollout.agents.calculator import calculator
from grimoire.rollout.agents.toolbox import build_tools, run_tool, tool_schema


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("37 * 48", "1776"),
        ("(12 + 5) / 4", "4.25"),
        ("8 / 2", "4"),  # exact division stays an integer
        ("0.1 + 0.2", "0.3"),  # rationals, not binary floats
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("2^10", "1024"),  # the caret as people write powers
        ("2 ** -2", "0.25"),
        ("-3 + +2", "-1"),
        ("6 × 7 =", "42"),  # a trailing "=" and the multiplication sign
        ("1.5e3", "1500"),
    ],
)
def test_arithmetic(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "not Call"),
        ("x + 1", "not Name"),
        ("'a' * 3", "not Constant"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "exponents must be whole numbers up to 64"),
        ("2 ** 0.5", "exponents must be whole numbers up to 64"),
        ("10 ** 60 * 10 ** 60", "more than 100 digits"),
        ("1e400", "not a finite number"),
        ("3 +", "cannot read"),
    ],
)
def test_refused(expression, message):
    out = calculator(expression)
    assert out.startswith("error: ") and message in out


def test_as_a_tool():
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    result = run_tool(build_tools([calculator]), "calculator", {"expression": "23 * 41"}, 5.0)
    assert (result.content, result.outcome) == ("943", "ok")
