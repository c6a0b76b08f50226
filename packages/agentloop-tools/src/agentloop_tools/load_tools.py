"""Build the tool set of a run from a YAML tool config and/or a Python file of function tools.

YAML format (verl-compatible)::

    tools:
      - class_name: agentloop_tools.builtin.gsm8k.Gsm8kTool
        config: {type: native, timeout_s: 5}
        tool_schema: {type: function, function: {name: check_answer, ...}}   # optional if the class has a default
      - class_name: agentloop_tools.builtin.calculator.calculator           # a @function_tool object
        config: {type: function}
      - config:
          type: mcp
          timeout_s: 30
        mcp:
          mcp_servers_config_path: mcp_servers.json     # relative to this YAML file
          # or inline:  mcpServers: {search: {url: http://127.0.0.1:8000/mcp}}
          tool_selected_list: [search]                  # optional
        class_name: my_pkg.MyMCPTool                    # optional MCPTool subclass

A ``class_name`` of verl's (``verl.tools.gsm8k_tool.Gsm8kTool``) is read as agentloop's tool, or
is an error naming what to use (:mod:`agentloop_tools.verl_tools`).

The function-tool file is imported by path; every module-level :class:`BaseTool` instance
(``@function_tool`` functions, or tool objects) is collected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentloop_core.imports import import_file, import_object
from agentloop_tools.base import BaseTool

__all__ = ["import_file", "import_object", "read_yaml_list", "load_function_tools", "load_tools", "load_tools_from_config",
           "tool_config_entries"]

logger = logging.getLogger(__name__)


def read_yaml_list(path: str | Path, key: str, *, what: str, entries: str) -> tuple[Path, list[Any]]:
    """The top-level ``key:`` list of a YAML config file (tool and interaction configs).

    Args:
        path: The YAML file.
        key: The top-level key holding the list.
        what: What the file is, for errors (``"tool config"``).
        entries: What the list holds, for errors (``"tool entries"``).

    Returns:
        ``(resolved path, the list)``.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not YAML, or no top-level ``key:`` list; the message names the file.
    """
    import yaml

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{what} {str(file)!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{file}: not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get(key), list):
        raise ValueError(f"{file}: expected a top-level '{key}:' list of {entries}")
    return file, data[key]


def load_function_tools(path: str | Path) -> dict[str, BaseTool]:
    """Import a Python file by path and collect its module-level tools.

    Args:
        path: A ``.py`` file with ``@function_tool`` functions or BaseTool instances.

    Returns:
        Tools by name (an object bound to several globals counts once).

    Raises:
        FileNotFoundError: No such file.
        ValueError: The file fails to import, defines no tool, or two tools share a name.
    """
    file = Path(path).expanduser().resolve()
    module = import_file(file, "function tool file", prefix="agentloop_function_tools")
    tools: dict[str, BaseTool] = {}
    where: dict[str, str] = {}
    for attr, value in vars(module).items():
        if not isinstance(value, BaseTool) or any(value is t for t in tools.values()):
            continue
        if value.name in tools:
            raise ValueError(
                f"{file}: tool name {value.name!r} is defined twice (by {where[value.name]!r} and {attr!r})"
            )
        tools[value.name] = value
        where[value.name] = attr
    if not tools:
        raise ValueError(f"{file}: defines no tools; decorate functions with @function_tool")
    return tools


def tool_config_entries(tool_config_path: str | Path,
                        notice: Callable[[str], None] = logger.info) -> list[tuple[str, dict[str, Any]]]:
    """The entries of a YAML tool config, each with its place (``file: tools[i]``), verl's tool
    classes read as ours (:mod:`agentloop_tools.verl_tools`); nothing is imported or contacted.

    Args:
        tool_config_path: The YAML file.
        notice: Receives one line per verl class or ``config:`` key read as agentloop's.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Bad YAML, an entry that is not a mapping, or a verl class agentloop has no
            counterpart for; one line naming the file and the entry.
    """
    from agentloop_tools.verl_tools import translate_tool_entry

    file, entries = read_yaml_list(tool_config_path, "tools", what="tool config", entries="tool entries")
    out = []
    for i, entry in enumerate(entries):
        key = f"{file}: tools[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{key}: each tool entry must be a mapping, got {type(entry).__name__}")
        entry, notices = translate_tool_entry(entry, key)
        for line in notices:
            notice(line)
        out.append((key, entry))
    return out


def load_tools_from_config(tool_config_path: str | Path) -> dict[str, BaseTool]:
    """Build the tools listed in a YAML tool config (see the module docstring).

    Raises:
        FileNotFoundError: No such file.
        ValueError: Bad YAML or a bad entry; the message names the file and the key.
    """
    tools: dict[str, BaseTool] = {}
    source: dict[str, str] = {}
    for key, entry in tool_config_entries(tool_config_path, notice=logger.info):
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema", "mcp"})
        if unknown:
            raise ValueError(f"{key}: unknown keys {unknown}; known: class_name, config, tool_schema, mcp")
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind == "native":
            built = _build_native(entry, config, key)
        elif kind == "mcp":
            built = _build_mcp(entry, config, key, Path(tool_config_path).expanduser().resolve().parent)
        elif kind == "function":
            built = _build_function(entry, config, key)
        else:
            raise ValueError(f"{key}.config.type: {kind!r} is not one of 'native', 'function', 'mcp'")
        for name, tool in built.items():
            if name in tools:
                raise ValueError(f"{key}: tool name {name!r} is already defined by {source[name]}")
            tools[name] = tool
            source[name] = key
    return tools


def _build_native(entry: Mapping[str, Any], config: dict[str, Any], key: str) -> dict[str, BaseTool]:
    if "class_name" not in entry:
        raise ValueError(f"{key}.class_name: missing; native tools need the import path of a BaseTool subclass")
    cls = import_object(entry["class_name"], where=f"{key}.class_name")
    if not isinstance(cls, type) or not issubclass(cls, BaseTool):
        raise ValueError(f"{key}.class_name: {entry['class_name']!r} is not a BaseTool subclass")
    config.pop("type", None)
    try:
        tool = cls(config, entry.get("tool_schema"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}: building {entry['class_name']} failed: {exc}") from exc
    return {tool.name: tool}


def _build_function(entry: Mapping[str, Any], config: dict[str, Any], key: str) -> dict[str, BaseTool]:
    """A ``@function_tool`` object (or any BaseTool instance) named by import path; it is
    shared as it is, so the entry takes no config or schema of its own."""
    if "class_name" not in entry:
        raise ValueError(f"{key}.class_name: missing; function tools need the import path of a @function_tool "
                         "object, e.g. agentloop_tools.builtin.calculator.calculator")
    tool = import_object(entry["class_name"], where=f"{key}.class_name")
    if not isinstance(tool, BaseTool):
        raise ValueError(f"{key}.class_name: {entry['class_name']!r} is a {type(tool).__name__}, not a tool; "
                         "decorate the function with @function_tool")
    extra = sorted(set(config) - {"type"}) + (["tool_schema"] if entry.get("tool_schema") is not None else [])
    if extra:
        raise ValueError(f"{key}: function tools take their settings from @function_tool(...); remove {extra}")
    return {tool.name: tool}


def _build_mcp(entry: Mapping[str, Any], config: dict[str, Any], key: str, base: Path) -> dict[str, BaseTool]:
    from agentloop_tools.mcp import MCPTool, load_mcp_tools

    mcp = entry.get("mcp")
    if not isinstance(mcp, Mapping):
        raise ValueError(f"{key}.mcp: mcp tools need an 'mcp:' mapping with mcp_servers_config_path or mcpServers")
    if ("mcp_servers_config_path" in mcp) == ("mcpServers" in mcp):
        raise ValueError(f"{key}.mcp: give exactly one of 'mcp_servers_config_path' or 'mcpServers'")
    if "mcpServers" in mcp:
        servers: Any = {"mcpServers": mcp["mcpServers"]}
    else:
        servers = Path(mcp["mcp_servers_config_path"]).expanduser()
        if not servers.is_absolute():
            servers = base / servers
        if not servers.is_file():
            raise ValueError(f"{key}.mcp.mcp_servers_config_path: {str(servers)!r} does not exist")
    tool_class = MCPTool
    if "class_name" in entry:
        tool_class = import_object(entry["class_name"], where=f"{key}.class_name")
        if not isinstance(tool_class, type) or not issubclass(tool_class, MCPTool):
            raise ValueError(f"{key}.class_name: {entry['class_name']!r} is not an MCPTool subclass")
    if entry.get("tool_schema") is not None:
        raise ValueError(f"{key}.tool_schema: MCP tools take their schema from the server; remove it")
    config.pop("type", None)
    try:
        return dict(
            load_mcp_tools(
                servers, tool_selected_list=mcp.get("tool_selected_list"), tool_class=tool_class, tool_config=config
            )
        )
    except ValueError as exc:
        raise ValueError(f"{key}.mcp: {exc}") from exc


def load_tools(
    tool_config_path: str | Path | None = None, function_tool_path: str | Path | None = None
) -> dict[str, BaseTool]:
    """All tools of a run: the YAML tool config plus a file of function tools, merged by name.

    Args:
        tool_config_path: YAML tool config, or None.
        function_tool_path: Python file of ``@function_tool`` functions, or None.

    Returns:
        Tools by name (empty when both paths are None).

    Raises:
        ValueError: A name is defined twice (the message names both sources), or a source is bad.
        FileNotFoundError: A path does not exist.
        ConnectionError: An MCP server could not be reached.
    """
    tools: dict[str, BaseTool] = {}
    source: dict[str, str] = {}
    if tool_config_path is not None:
        for name, tool in load_tools_from_config(tool_config_path).items():
            tools[name], source[name] = tool, f"tool config {str(tool_config_path)!r}"
    if function_tool_path is not None:
        for name, tool in load_function_tools(function_tool_path).items():
            if name in tools:
                raise ValueError(
                    f"tool name {name!r} is defined twice: in {source[name]} and in function tool file "
                    f"{str(function_tool_path)!r}; rename one"
                )
            tools[name], source[name] = tool, f"function tool file {str(function_tool_path)!r}"
    return tools
