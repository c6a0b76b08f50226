"""load_tools: YAML tool configs + a Python file of function tools, merged by name."""

import textwrap

import pytest

from agentloop_tools.builtin.gsm8k import Gsm8kTool
from agentloop_tools.function_tool import FunctionTool
from agentloop_tools.load_tools import import_object, load_function_tools, load_tools

FUNCTIONS = '''
from agentloop_tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


@function_tool("shout")
async def upper(text: str) -> str:
    """Upper-case text."""
    return text.upper()


alias = add  # the same tool bound twice counts once
'''

YAML = """
tools:
  - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool
    config: {type: native, timeout_s: 5}
  - class_name: agentloop_tools.builtin.sandbox.PythonSandboxTool
    config: {timeout_s: 3}
    tool_schema:
      type: function
      function:
        name: run_code
        description: Run Python.
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


async def test_yaml_and_function_file_merge(tmp_path):
    tools = load_tools(_write(tmp_path, "tools.yaml", YAML), _write(tmp_path, "fns.py", FUNCTIONS))
    assert sorted(tools) == ["add", "check_answer", "run_code", "shout"]
    assert isinstance(tools["check_answer"], Gsm8kTool)
    assert tools["check_answer"].timeout_s == 5.0
    assert isinstance(tools["add"], FunctionTool)
    iid = await tools["shout"].create()
    assert (await tools["shout"].execute(iid, {"text": "hi"}))[0].text == "HI"
    iid = await tools["run_code"].create()
    assert (await tools["run_code"].execute(iid, {"code": "print(2**5)"}))[0].text == "32\n"


def test_nothing_given_is_empty():
    assert load_tools() == {}


def test_duplicate_name_across_sources_names_both(tmp_path):
    yaml_path = _write(
        tmp_path,
        "tools.yaml",
        """
        tools:
          - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool
            config: {type: native}
            tool_schema: {type: function, function: {name: add, description: clash}}
        """,
    )
    fn_path = _write(tmp_path, "fns.py", FUNCTIONS)
    with pytest.raises(ValueError, match="'add' is defined twice") as err:
        load_tools(yaml_path, fn_path)
    assert "tools.yaml" in str(err.value)
    assert "fns.py" in str(err.value)


def test_duplicate_name_inside_yaml(tmp_path):
    yaml_path = _write(
        tmp_path,
        "dup.yaml",
        """
        tools:
          - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool
          - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool
        """,
    )
    with pytest.raises(ValueError, match=r"tools\[1\]: tool name 'check_answer' is already defined by .*tools\[0\]"):
        load_tools(yaml_path)


def test_duplicate_name_inside_function_file(tmp_path):
    path = _write(
        tmp_path,
        "two.py",
        '''
        from agentloop_tools.function_tool import function_tool

        @function_tool("same")
        def a(x: int) -> int:
            """A."""
            return x

        @function_tool("same")
        def b(x: int) -> int:
            """B."""
            return x
        ''',
    )
    with pytest.raises(ValueError, match=r"'same' is defined twice \(by 'a' and 'b'\)"):
        load_function_tools(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: [\n  - {class_name: x", "not valid YAML"),
        ("other: 1", "top-level 'tools:' list"),
        ("tools:\n  - class_name: no_such_pkg.mod.Tool", r"tools\[0\]\.class_name: cannot import module 'no_such_pkg.mod'"),
        ("tools:\n  - class_name: agentloop_tools.builtin.gsm8k.Missing", r"tools\[0\]\.class_name: module .* has no attribute 'Missing'"),
        ("tools:\n  - class_name: agentloop_tools.schema.ToolResponse", "is not a BaseTool subclass"),
        ("tools:\n  - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool\n    config: {type: grpc}", r"tools\[0\]\.config\.type: 'grpc'"),
        ("tools:\n  - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool\n    cfg: {}", r"unknown keys \['cfg'\]"),
        ("tools:\n  - config: {type: native}", r"tools\[0\]\.class_name: missing"),
        ("tools:\n  - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool\n    config: {timeout_s: abc}", "timeout_s must be a positive number"),
        ("tools:\n  - config: {type: mcp}", r"tools\[0\]\.mcp: mcp tools need"),
    ],
)
def test_bad_config_errors_name_file_and_key(tmp_path, text, message):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(ValueError, match=message) as err:
        load_tools(path)
    assert "bad.yaml" in str(err.value)


def test_bad_function_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tools(function_tool_path=tmp_path / "missing.py")
    with pytest.raises(ValueError, match="defines no tools"):
        load_function_tools(_write(tmp_path, "empty.py", "x = 1\n"))
    with pytest.raises(ValueError, match="importing the function tool file failed: ZeroDivisionError"):
        load_function_tools(_write(tmp_path, "broken.py", "1 / 0\n"))


def test_import_object_forms():
    assert import_object("agentloop_tools.builtin.gsm8k.Gsm8kTool") is Gsm8kTool
    assert import_object("agentloop_tools.builtin.gsm8k:Gsm8kTool") is Gsm8kTool
    with pytest.raises(ValueError, match="not a dotted import path"):
        import_object("Gsm8kTool")
