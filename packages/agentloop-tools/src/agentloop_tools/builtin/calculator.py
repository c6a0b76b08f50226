"""A calculator tool that evaluates arithmetic with an AST walker, never ``eval``.

Only numbers, ``+ - * / // % **``, unary ``+``/``-`` and parentheses are accepted. Limits on
length, nesting depth, exponent size and result magnitude stop a model from burning CPU or
memory with ``9**9**9`` or a million nested parentheses.

Characters are checked against printable ASCII before Python's parser sees them: the parser
accepts (and chokes on) far more than arithmetic, e.g. a lone surrogate raises
``UnicodeEncodeError`` and NFKC folds ``ｘ`` into a name. Digits of other scripts and
superscripts are refused rather than guessed at (NFKC reads ``2²`` as ``22``).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass

from agentloop_tools.function_tool import FunctionTool

__all__ = ["CalculatorError", "CalculatorLimits", "calculator", "evaluate_expression", "format_number"]


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


@dataclass(frozen=True)
class CalculatorLimits:
    """Bounds on what one expression may cost."""

    max_length: int = 256
    """Most characters in the expression."""
    max_depth: int = 32
    """Deepest nesting of operations."""
    max_exponent: int = 1024
    """Largest absolute exponent for ``**``."""
    max_abs_result: float = 1e100
    """Largest absolute value of any intermediate or final result."""


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
_ALLOWED_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F)) | frozenset("\t\r\n")
"""Printable ASCII: the AST walk then refuses names, calls and strings with a message that says
which, rather than "bad character"."""


def evaluate_expression(expression: str, limits: CalculatorLimits = CalculatorLimits()) -> int | float:
    """Evaluate an arithmetic expression safely.

    Args:
        expression: e.g. ``"(3 + 4) * 2 / 7"``.
        limits: Cost bounds.

    Returns:
        An int when every step stayed integral, else a float.

    Raises:
        CalculatorError: Disallowed syntax (names, calls, attributes...), a limit exceeded,
            division by zero, or a result that is not finite.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > limits.max_length:
        raise CalculatorError(f"expression is {len(expression)} characters; the limit is {limits.max_length}")
    bad = next((i for i, c in enumerate(expression) if c not in _ALLOWED_CHARS), None)
    if bad is not None:
        c = expression[bad]
        shown = repr(c) if c.isprintable() and c.isascii() else f"U+{ord(c):04X}"
        raise CalculatorError(f"character {shown} at position {bad} is not allowed; write numbers with ASCII digits "
                              "0-9 and use only + - * / // % ** and parentheses")
    if not expression.strip():
        raise CalculatorError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid arithmetic expression: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError(f"expression is nested too deeply (limit {limits.max_depth})") from None
    try:
        return _eval(tree.body, limits, 0)
    except CalculatorError:
        raise
    except (ArithmeticError, ValueError, TypeError, RecursionError, MemoryError) as exc:
        # A backstop: the walk above is meant to refuse everything first, but a tool call must
        # never crash on arithmetic the limits did not foresee.
        raise CalculatorError(f"cannot evaluate: {type(exc).__name__}: {exc}") from None


def _eval(node: ast.AST, limits: CalculatorLimits, depth: int) -> int | float:
    if depth > limits.max_depth:
        raise CalculatorError(f"expression is nested too deeply (limit {limits.max_depth})")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {value!r}")
        return _check(value, limits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, limits, depth + 1)), limits)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, limits, depth + 1)
        right = _eval(node.right, limits, depth + 1)
        if isinstance(node.op, ast.Pow):
            if abs(right) > limits.max_exponent:
                raise CalculatorError(f"exponent {right} is too large (limit {limits.max_exponent})")
            # Bound the result before computing it: a big int power is computed eagerly.
            if left not in (0, 1, -1) and abs(right) * math.log10(abs(left)) > math.log10(limits.max_abs_result):
                raise CalculatorError(f"result of {left}**{right} is too large (limit {limits.max_abs_result:g})")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("result is a complex number (fractional power of a negative number)")
        return _check(result, limits)
    kind = type(node).__name__
    hint = {"Name": "names", "Call": "function calls", "Attribute": "attributes"}.get(kind, kind)
    raise CalculatorError(
        f"{hint} are not allowed; use only numbers, + - * / // % **, and parentheses"
    )


def _check(value: int | float, limits: CalculatorLimits) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > limits.max_abs_result:
        raise CalculatorError(f"result is too large (limit {limits.max_abs_result:g})")
    return value


def format_number(value: int | float) -> str:
    """Render a result: ints as ints (``15``), integral floats without ``.0``, others rounded
    to 10 significant digits (``0.1 + 0.2`` -> ``0.3``)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.10g}"


def _calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    return format_number(evaluate_expression(expression))


calculator: FunctionTool = FunctionTool(_calculator, name="calculator", config={"inline": True})
"""The calculator as a ready-made tool (``calculator(expression: str) -> str``). It runs on the
event loop (``inline``): :class:`CalculatorLimits` bound what one call costs (microseconds), so a
thread of its own would only add the wait for the GIL."""
