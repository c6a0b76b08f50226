"""@function_tool: schema inference from hints + Google docstrings, execution, normalisation."""

import asyncio
import enum
import threading
from typing import Any, Literal, Optional

import pytest

from agentloop_tools.base import BaseTool, ToolKwargsError
from agentloop_tools.function_schema import json_schema_for_type, parse_google_docstring
from agentloop_tools.function_tool import FunctionTool, function_tool, normalize_tool_result
from agentloop_tools.schema import ToolResponse


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@pytest.mark.parametrize(
    ("tp", "expected"),
    [
        (str, {"type": "string"}),
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (Any, {}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (list[list[str]], {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}),
        (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
        (dict, {"type": "object"}),
        (Optional[str], {"type": ["string", "null"]}),  # noqa: UP045 - the old spelling must work too
        (int | None, {"type": ["integer", "null"]}),
        (int | float, {"type": ["integer", "number"]}),
        (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
        (Literal[1, 2], {"type": "integer", "enum": [1, 2]}),
        (Color, {"type": "string", "enum": ["red", "blue"]}),
        (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
        (
            Optional[list[int]],  # noqa: UP045
            {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
        ),
    ],
)
def test_json_schema_for_each_type(tp, expected):
    assert json_schema_for_type(tp) == expected


def test_unsupported_types_are_errors():
    with pytest.raises(TypeError, match="dict keys must be str"):
        json_schema_for_type(dict[int, str])
    with pytest.raises(TypeError, match="no JSON-schema equivalent"):
        json_schema_for_type(threading.Lock)


def test_schema_from_hints_and_google_docstring():
    @function_tool
    def search(query: str, k: int = 5, mode: Literal["fast", "exact"] = "fast", tags: list[str] | None = None) -> str:
        """Search the index.

        Returns the top hits.

        Args:
            query: What to look for,
                possibly several words.
            k (int): How many hits.
            mode: Search mode.
            tags: Optional filter.

        Returns:
            JSON hits.
        """
        return query

    assert isinstance(search, BaseTool)
    assert isinstance(search, FunctionTool)
    fn = search.tool_schema.model_dump(exclude_none=True)["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the index. Returns the top hits."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for, possibly several words."}
    assert props["k"] == {"type": "integer", "description": "How many hits.", "default": 5}
    assert props["mode"]["enum"] == ["fast", "exact"]
    assert props["tags"]["anyOf"] == [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]
    assert props["tags"]["default"] is None
    assert fn["parameters"]["required"] == ["query"]  # required = no default
    assert search("x") == "x"  # still callable like the function


def test_decorator_forms_and_names():
    @function_tool("lookup")
    def f(x: int) -> int:
        """Look up."""
        return x

    @function_tool(description="Given description.")
    def g(x: int) -> int:
        return x

    schema = {"type": "function", "function": {"name": "custom", "description": "d", "parameters": {"type": "object", "properties": {"y": {"type": "string"}}}}}

    @function_tool(schema=schema)
    def h(y):
        return y

    assert f.name == "lookup"
    assert f.tool_schema.function.name == "lookup"
    assert g.tool_schema.function.description == "Given description."
    assert h.name == "custom"
    assert "y" in h.tool_schema.function.parameters.properties


def test_registration_errors_are_clear():
    with pytest.raises(TypeError, match=r"\*args is not allowed"):

        @function_tool
        def a(*args: int) -> None:
            """Doc."""

    with pytest.raises(TypeError, match=r"\*\*kw is not allowed"):

        @function_tool
        def b(x: int, **kw: int) -> None:
            """Doc."""

    with pytest.raises(ValueError, match="has no description"):

        @function_tool
        def c(x: int) -> None:
            pass

    with pytest.raises(ValueError, match=r"documents \['y'\]"):

        @function_tool
        def d(x: int) -> None:
            """Doc.

            Args:
                y: not a parameter.
            """


def test_parse_docstring_without_args_section():
    assert parse_google_docstring("Only a summary.") == ("Only a summary.", {})
    assert parse_google_docstring(None) == ("", {})


async def test_sync_runs_in_thread_async_is_awaited():
    main_thread = threading.get_ident()

    @function_tool
    def sync_tool(x: int) -> dict:
        """Sync."""
        return {"thread": threading.get_ident(), "x": x}

    @function_tool
    async def async_tool(x: int) -> str:
        """Async."""
        await asyncio.sleep(0)
        return f"got {x}"

    iid = await sync_tool.create()
    resp, reward, metrics = await sync_tool.execute(iid, {"x": 3})
    assert '"x": 3' in resp.text
    assert str(main_thread) not in resp.text
    assert (reward, metrics) == (0.0, {})
    iid2 = await async_tool.create()
    assert (await async_tool.execute(iid2, {"x": 4}))[0].text == "got 4"


async def test_bad_arguments_raise_clear_error():
    @function_tool
    def f(x: int) -> str:
        """F."""
        return str(x)

    iid = await f.create()
    with pytest.raises(TypeError, match="bad arguments"):
        await f.execute(iid, {"y": 1})


@pytest.mark.parametrize(
    ("result", "text", "reward", "metrics"),
    [
        ("hi", "hi", 0.0, {}),
        ({"a": [1, "é"]}, '{"a": [1, "é"]}', 0.0, {}),
        ([1, 2], "[1, 2]", 0.0, {}),
        (7, "7", 0.0, {}),
        (None, "", 0.0, {}),
        (ToolResponse(text="t"), "t", 0.0, {}),
        (("ok", 1), "ok", 1.0, {}),
        (({"r": 1}, 0.5, {"m": 2}), '{"r": 1}', 0.5, {"m": 2}),
    ],
)
def test_return_normalisation(result, text, reward, metrics):
    resp, r, m = normalize_tool_result(result)
    assert (resp.text, r, m) == (text, reward, metrics)


@pytest.mark.parametrize("bad", [object(), ("a", "b"), ("a", 1, [1]), ("a",), ("a", 1, {}, 2)])
def test_bad_return_values(bad):
    with pytest.raises(TypeError):
        normalize_tool_result(bad, tool_name="t")


async def test_calc_reward_sums_step_rewards():
    @function_tool
    def scored(x: int) -> tuple:
        """Scored."""
        return "ok", float(x)

    iid = await scored.create()
    await scored.execute(iid, {"x": 1})
    await scored.execute(iid, {"x": 2})
    assert await scored.calc_reward(iid) == 3.0


async def test_hidden_parameters_come_from_the_row_and_stay_out_of_the_schema():
    @function_tool(hidden_params=["user_id", "region"])
    def lookup(query: str, user_id: str, region: str = "eu") -> str:
        """Look up the user's records.

        Args:
            query: What to look up.
            user_id: Whose records (from the dataset row).
            region: Where they are stored.
        """
        return f"{user_id}/{region}/{query}"

    params = lookup.tool_schema.function.parameters
    assert list(params.properties) == ["query"]
    assert params.required == ["query"]
    iid = await lookup.create(create_kwargs={}, execute_kwargs={"user_id": "u7"})
    assert (await lookup.run_execute(iid, {"query": "q"}))[0].text == "u7/eu/q"
    # The model cannot set a hidden parameter, even one it guessed.
    with pytest.raises(TypeError, match=r"unexpected arguments \['user_id'\]; expected \['query'\]"):
        await lookup.run_execute(iid, {"query": "q", "user_id": "admin"})
    with pytest.raises(ToolKwargsError, match=r"hidden parameters \['user_id'\] have no default"):
        await lookup.create()
    with pytest.raises(ToolKwargsError, match=r"keys \['tenant'\] that are not hidden parameters"):
        await lookup.create(execute_kwargs={"user_id": "u", "tenant": "t"})
    assert lookup.live_instances == 1


async def test_row_kwargs_for_a_function_without_hidden_parameters_are_an_error():
    @function_tool
    def shout(text: str) -> str:
        """Shout."""
        return text.upper()

    iid = await shout.create(execute_kwargs={})  # none given: fine
    assert (await shout.run_execute(iid, {"text": "a"}))[0].text == "A"
    with pytest.raises(ToolKwargsError, match=r"function tool 'shout'.*hidden_params"):
        await shout.create(execute_kwargs={"lang": "en"})
    with pytest.raises(ToolKwargsError, match="calc_reward"):
        await shout.create(calc_reward_kwargs={"gt": 1})


def test_hidden_parameter_declaration_errors():
    def f(x: int, y: int = 0) -> str:
        """F."""
        return ""

    with pytest.raises(TypeError, match="hidden parameter 'z' is not a named parameter"):
        FunctionTool(f, hidden_params=["z"])
    schema = {"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]}}}
    with pytest.raises(ValueError, match=r"shows hidden parameters \['y'\]"):
        FunctionTool(f, schema=schema, hidden_params=["y"])
