"""The calculator: correct arithmetic, and no way to run code or exhaust the machine."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_tools.builtin.calculator import CalculatorError, calculator, evaluate_expression, format_number


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(3 + 4) * 2 / 7", "2"),  # float 2.0 prints as an int
        ("30 / 2", "15"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-(-3)", "3"),
        ("+5", "5"),
        ("0.1 + 0.2", "0.3"),
        ("10 / 3", "3.333333333"),
        ("2 ** -1", "0.5"),
        ("1e3 * 2", "2000"),
    ],
)
def test_results(expr, expected):
    assert format_number(evaluate_expression(expr)) == expected


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("__import__('os')", "function calls are not allowed"),
        ("os.system", "attributes are not allowed"),
        ("x + 1", "names are not allowed"),
        ("9**9**9", "too large"),
        ("2 ** 100000", "too large"),
        ("10 ** 101", "too large"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "complex"),
        ("'a' * 3", "only numbers"),
        ("[1, 2]", "not allowed"),
        ("1 +", "not a valid arithmetic expression"),
        ("(1+" * 40 + "1" + ")" * 40, "nested too deeply"),
        ("-" * 60 + "1", "nested too deeply"),
        ("1" * 300, "limit is 256"),
        ("True + 1", "only numbers"),
        ("", "empty"),
        ("lambda: 1", "not allowed"),
    ],
)
def test_rejections(expr, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate_expression(expr)


_int_expr = st.recursive(
    st.integers(min_value=-1000, max_value=1000).map(lambda n: f"({n})"),
    lambda inner: st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(_int_expr)
def test_integer_arithmetic_matches_python(expr):
    expected = eval(expr)  # the test oracle evaluates trusted, generated input only
    assert evaluate_expression(expr) == expected
    assert format_number(evaluate_expression(expr)) == str(expected)


def test_calculator_tool_end_to_end():
    async def run():
        iid = await calculator.create()
        resp, reward, _ = await calculator.execute(iid, {"expression": "12 * (3 + 4)"})
        await calculator.release(iid)
        return resp.text, reward

    assert asyncio.run(run()) == ("84", 0.0)
    assert calculator.tool_schema.function.parameters.required == ["expression"]
