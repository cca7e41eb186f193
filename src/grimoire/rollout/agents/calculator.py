"""A calculator tool for agentic recipes: arithmetic on numbers, read as a syntax tree, never
evaluated as Python.

``calculator("37 * 48")`` -> ``"1776"``. The expression may use numbers, ``+ - * / // % **``,
unary signs and parentheses; anything else (names, calls, attributes, strings) is refused with a
message the model can read. Powers are bounded (exponent at most :data:`MAX_EXPONENT`, results
at most :data:`MAX_DIGITS` digits) so that a sampled ``9**9**9`` cannot stall a rollout.
Division is exact where it can be (``"7 / 2"`` -> ``"3.5"``, ``"8 / 2"`` -> ``"4"``).

Use it as a tool (``loss.args.tools: ["grimoire.rollout.agents.calculator:calculator"]``); its schema
comes from the signature and docstring like any tool's (:mod:`grimoire.rollout.agents.toolbox`).
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

#: The largest exponent ``**`` accepts.
MAX_EXPONENT = 64
#: The most digits a result (or an intermediate value) may have.
MAX_DIGITS = 100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses (its message is what the model reads)."""


def _check_size(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
    return value


def _value(node: ast.AST) -> Fraction:
    # Fractions throughout: "0.1 + 0.2" is 0.3 and "10 / 4 * 2" is 5, as a person expects.
    # bool is an int subclass: True + 1 is not arithmetic a model should get away with.
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise CalculatorError(f"{value} is not a finite number")
        return _check_size(Fraction(str(value)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            return _check_size(left ** int(right))
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalculatorError("division by zero")
        return _check_size(_BINARY[type(node.op)](left, right))
    raise CalculatorError(
        f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}"
    )


def _text(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, such as 37 * 48 or (12 + 5) / 4.

    Args:
        expression: the arithmetic expression to compute, with numbers and + - * / ( )
    """
    text = str(expression).replace("×", "*").replace("÷", "/").replace("^", "**").strip()
    text = text.rstrip("=").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return f"error: cannot read {expression!r} as arithmetic"
    try:
        return _text(_value(tree.body))
    except CalculatorError as exc:
        return f"error: {exc}"


__all__ = ["MAX_DIGITS", "MAX_EXPONENT", "CalculatorError", "calculator"]
