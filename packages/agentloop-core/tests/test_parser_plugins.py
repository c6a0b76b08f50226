"""Parsers as plug-ins: a package installed with entry points in ``agentloop.tool_parsers`` and
``agentloop.reasoning_parsers`` (a real dist-info on ``sys.path``, read by importlib.metadata)
adds parsers found by name like the built-in ones; a broken entry point is named without
hiding the others. Also the registry helper every registry shares
(:class:`agentloop_core.plugins.PluginRegistry`).

A failure in the entry-point tests means the registry no longer reads its group (or reads it
before the package was installed and never again); a failure in the helper tests names the
message or rule that changed.
"""

from __future__ import annotations

import sys

import pytest

from agentloop_core.parsers import (
    HermesToolParser,
    ToolParser,
    UnknownToolParserError,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from agentloop_core.plugins import InvalidPluginError, PluginRegistry, UnknownPluginError
from agentloop_core.reasoning import UnknownReasoningParserError, get_reasoning_parser, reasoning_parser_names
from agentloop_core.testing.plugin_dist import installed_parser_plugins, write_distribution

CALC = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture
def plugins(tmp_path):
    with installed_parser_plugins(tmp_path) as root:
        yield root


def test_an_installed_tool_parser_is_found_by_name_and_parses(plugins):
    assert "demo_angle" in tool_parser_names()
    parser = get_tool_parser("demo_angle")
    assert type(parser).__module__ == "agentloop_demo_parsers"
    assert parser.name == "demo_angle"
    assert parser.call_openings == ("<call>",)
    assert get_tool_parser("demo_angle") is parser  # one shared instance, as for the built-ins
    result = parser.parse('Let me add.\n<call>{"name": "calculator", "arguments": {"expression": "3+4"}}</call>',
                          {"calculator": CALC})
    assert result.content == "Let me add."
    assert [(c.name, c.arguments) for c in result.calls] == [("calculator", {"expression": "3+4"})]
    assert not result.errors


def test_a_plugin_is_found_when_installed_after_the_first_lookup(tmp_path):
    assert "demo_angle" not in tool_parser_names()  # the group has been read already, without it
    with installed_parser_plugins(tmp_path):
        assert get_tool_parser("demo_angle").name == "demo_angle"
    with pytest.raises(UnknownToolParserError):
        get_tool_parser("demo_angle")  # and forgotten once uninstalled


def test_an_installed_reasoning_parser_is_found_by_name_and_splits(plugins):
    assert "demo_brackets" in reasoning_parser_names()
    parser = get_reasoning_parser("demo_brackets")
    assert parser.name == "demo_brackets"
    assert parser.delimiters == ("[think]", "[/think]")
    split = parser.split("[think] 3 and 4 [/think]It is 7.")
    assert (split.reasoning, split.content) == ("3 and 4", "It is 7.")


def test_broken_entry_points_are_named_and_hide_nothing(plugins):
    with pytest.raises(UnknownToolParserError, match=r"'demo_broken' is installed but broken: entry point "
                                                     r"'agentloop_no_such_parser_module:Parser' failed to import"):
        get_tool_parser("demo_broken")
    with pytest.raises(UnknownToolParserError, match=r"'demo_not_a_parser' is installed but broken: .*is not an "
                                                     r"agentloop_core.parsers.ToolParser subclass"):
        get_tool_parser("demo_not_a_parser")
    assert get_tool_parser("demo_angle").name == "demo_angle"
    assert get_tool_parser("hermes").name == "hermes"
    with pytest.raises(UnknownToolParserError) as info:
        get_tool_parser("demo_angel")
    message = str(info.value)
    assert "did you mean 'demo_angle'?" in message
    assert "installed but broken: demo_broken, demo_not_a_parser" in message
    assert "'agentloop.tool_parsers'" in message
    with pytest.raises(UnknownReasoningParserError, match=r"unknown reasoning parser 'nope'; .*demo_brackets.*"
                                                          r"'agentloop.reasoning_parsers'"):
        get_reasoning_parser("nope")


def test_an_entry_point_must_agree_with_the_name_its_class_registers(tmp_path):
    source = """
        from agentloop_core.parsers import ParseResult, ToolParser, register_tool_parser

        @register_tool_parser("demo_named_in_code")
        class Named(ToolParser):
            def _parse(self, text, tools):
                return ParseResult(content=text)
    """
    with installed_parser_plugins(tmp_path, modules={"agentloop_demo_misnamed": source}, entry_points={
            "agentloop.tool_parsers": {"demo_misnamed": "agentloop_demo_misnamed:Named"}}):
        with pytest.raises(UnknownToolParserError, match=r"holds the tool parser named 'demo_named_in_code'; the "
                                                         r"entry-point name and the name the class registers must agree"):
            get_tool_parser("demo_misnamed")
        assert get_tool_parser("demo_named_in_code").name == "demo_named_in_code"  # its decorator still ran
    assert "demo_named_in_code" not in tool_parser_names()


def test_a_name_registered_twice_is_refused_naming_the_holder():
    class Other(ToolParser):
        def _parse(self, text, tools):
            raise NotImplementedError

    with pytest.raises(ValueError, match=r"tool parser name 'hermes' is already registered by "
                                         r"agentloop_core.parsers.hermes.HermesToolParser; pick another name"):
        register_tool_parser("hermes")(Other)
    with pytest.raises(ValueError, match=r"tool parser name 'harmony' is already registered by .*GptOssToolParser"):
        register_tool_parser("demo_other", aliases=("harmony",))(Other)
    assert "demo_other" not in tool_parser_names()
    assert register_tool_parser("hermes")(HermesToolParser) is HermesToolParser  # the holder itself: no conflict


# ---- the helper ---------------------------------------------------------------------------------


class _Error(UnknownPluginError):
    pass


def _registry(group: str = "agentloop.test_widgets", **kwargs) -> PluginRegistry[object]:
    return PluginRegistry("widget", group, error=_Error, how_to_add=lambda name: f"Add {name!r} somehow.", **kwargs)


def test_helper_lists_aliases_suggests_a_close_name_and_says_how_to_add_one():
    widgets = _registry()
    first, second = object(), object()
    widgets.add("sprocket", first, aliases=("cog",))
    widgets.add("flange", second)
    assert widgets.get("cog") is widgets.get("sprocket") is first
    assert widgets.names() == ["cog", "flange", "sprocket"]
    assert widgets.names(aliases=False) == ["flange", "sprocket"]
    with pytest.raises(_Error) as info:
        widgets.get("sprockt")
    assert str(info.value) == ("unknown widget 'sprockt'; known widgets: cog (alias of sprocket), flange, sprocket "
                               "(did you mean 'sprocket'?). Add 'sprockt' somehow.")
    with pytest.raises(ValueError, match=r"widget name 'cog' is already registered by <object"):
        widgets.add("other", object(), aliases=("cog",))
    with pytest.raises(TypeError, match="widget plug-ins declare no capability record"):
        widgets.capabilities("sprocket")


def test_helper_capabilities_and_value_equality():
    widgets = _registry(same=lambda a, b: a == b, capabilities=lambda w: {"size": len(w)})
    widgets.add("pair", ("a", "b"))
    widgets.add("pair", ("a", "b"))  # an equal record again is no conflict
    assert widgets.capabilities("pair") == {"size": 2}
    with pytest.raises(ValueError, match="already registered"):
        widgets.add("pair", ("c",))


def test_helper_two_packages_declaring_one_name_is_a_broken_name(tmp_path, monkeypatch):
    group = "agentloop.test_widgets_twice"
    for n, dist in enumerate(("agentloop-demo-one", "agentloop-demo-two")):
        write_distribution(tmp_path / dist, dist, modules={f"agentloop_demo_widget_{n}": f"WIDGET = {n}\n"},
                           entry_points={group: {"gear": f"agentloop_demo_widget_{n}:WIDGET", f"only_{n}":
                                                 f"agentloop_demo_widget_{n}:WIDGET"}})
        monkeypatch.syspath_prepend(str(tmp_path / dist))
        monkeypatch.delitem(sys.modules, f"agentloop_demo_widget_{n}", raising=False)  # gone afterwards
    widgets = _registry(group, adopt=_adopt_int)
    assert widgets.get("only_0") == 0
    assert widgets.get("only_1") == 1
    with pytest.raises(_Error, match=r"'gear' is installed but broken: more than one installed package declares "
                                     r"it in 'agentloop.test_widgets_twice' \(agentloop_demo_widget_0:WIDGET, "
                                     r"agentloop_demo_widget_1:WIDGET\); uninstall all but one"):
        widgets.get("gear")
    assert widgets.names(include_broken=True) == ["gear", "only_0", "only_1"]


def _adopt_int(name: str, obj: object) -> int:
    if not isinstance(obj, int):
        raise InvalidPluginError(f"is not an int (got {type(obj).__name__})")
    return obj
