"""verl's built-in tool classes, read as agentloop's: the table and the entry rewrite.

A verl tool config names verl's classes (``class_name: verl.tools.gsm8k_tool.Gsm8kTool``), and
verl is not installed here. :data:`VERL_TOOL_CLASSES` says what each one is read as: one of our
tools, with its ``config:`` keys renamed or dropped (each with a one-line notice), or nothing,
with what to use instead (a one-line error). :func:`translate_tool_entry` applies it to one
entry; :func:`~agentloop_tools.load_tools.load_tools_from_config` calls it on every entry, and
the trainer calls it at config load so the notices and errors come before the run starts. The
migration guide (``docs/migrate-from-verl.md``) is generated from the same table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["VERL_TOOL_CLASSES", "VerlTool", "is_verl_class", "translate_tool_entry"]


@dataclass(frozen=True)
class VerlTool:
    """What one verl tool class is read as."""

    ours: str | None
    """Our class (import path); None where agentloop has no counterpart."""
    note: str
    """How ours differs (said in the notice), or, where ``ours`` is None, what to use instead."""
    kind: str = "native"
    """The entry's ``config.type`` here: ``native`` or ``mcp`` (our MCP tools need no class)."""
    renamed: Mapping[str, str] = field(default_factory=dict)
    """verl ``config:`` key -> ours (same meaning)."""
    dropped: Mapping[str, str] = field(default_factory=dict)
    """verl ``config:`` key -> why it has no effect here (removed, with a notice)."""
    only: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """verl ``config:`` key -> (the one value agentloop honours, why); removed at that value."""


_POOL = "agentloop runs tool calls on the rollout's event loop; there is no worker pool to size"

_GSM8K = VerlTool(
    "agentloop_tools.builtin.gsm8k.Gsm8kTool",
    "the same check of the answer against tools_kwargs' ground_truth; one checked answer per trajectory, the last one's 1.0/0.0 (max_attempts, score)",
)

_MCP = VerlTool(
    None,
    "each tool of the MCP servers becomes an agentloop_tools.mcp.MCPTool returning the server's text",
    kind="mcp",
    renamed={"timeout": "timeout_s"},
    dropped={"use_mcp": "the entry's config.type is mcp",
             "rate_limit": "set rate_limit (calls per second) on the server in the mcpServers file"},
)

VERL_TOOL_CLASSES: dict[str, VerlTool] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": _GSM8K,
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": _GSM8K,
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": VerlTool(
        "agentloop_tools.builtin.image_zoom.ImageZoomInTool",
        "the crop of tools_kwargs' image, enlarged to at least 28 pixels a side",
        dropped={"num_workers": _POOL, "rate_limit": _POOL, "enable_global_rate_limit": _POOL},
    ),
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": VerlTool(
        "agentloop_tools.builtin.sandbox.PythonSandboxTool",
        "the code runs in a limited local subprocess, not on a SandboxFusion server",
        renamed={"default_timeout": "timeout_s", "memory_limit_mb": "memory_mb"},
        dropped={"sandbox_fusion_url": "the code runs locally", "num_workers": _POOL, "rate_limit": _POOL,
                 "enable_global_rate_limit": _POOL},
        only={"default_language": ("python", "the sandbox runs Python only")},
    ),
    "verl.tools.mcp_base_tool.MCPBaseTool": _MCP,
    "verl.tools.mcp_search_tool.MCPSearchTool": VerlTool(
        None, _MCP.note + " (verl's search tool also parsed the results into metrics)", kind="mcp",
        renamed=_MCP.renamed, dropped=_MCP.dropped),
    "verl.tools.search_tool.SearchTool": VerlTool(
        None, "serve the retriever as an MCP server (config.type: mcp) or call it from a @function_tool "
              "(config.type: function)"),
    "verl.tools.geo3k_tool.Geo3kTool": VerlTool(
        None, "write a BaseTool subclass whose calc_reward grades the answer "
              "(agentloop_tools.builtin.gsm8k.Gsm8kTool is one to copy), or score with custom_reward_function"),
}
"""verl tool class -> what it is read as. A class of ``kind: mcp`` needs no class of ours (the
entry becomes an MCP entry); a native one with ``ours`` None is an error naming ``note``."""


def is_verl_class(class_name: Any) -> bool:
    """Whether ``class_name`` names a class of verl's package."""
    return isinstance(class_name, str) and class_name.split(".", 1)[0] == "verl"


def translate_tool_entry(entry: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """Rewrite a tool entry that names a verl class into ours.

    Args:
        entry: One item of the tool config's ``tools:`` list.
        where: The entry's place, for messages (``tools.yaml: tools[0]``).

    Returns:
        ``(the entry as agentloop reads it, one notice line per change)``; an entry that names
        no verl class comes back unchanged with no notices.

    Raises:
        ValueError: a verl class agentloop has no counterpart for, or a ``config:`` value it
            cannot honour; one line naming the class and what to use.
    """
    name = entry.get("class_name")
    if not is_verl_class(name):
        return dict(entry), []
    assert isinstance(name, str)
    spec = VERL_TOOL_CLASSES.get(name)
    if spec is None:
        known = ", ".join(sorted(VERL_TOOL_CLASSES))
        raise ValueError(f"{where}.class_name: {name!r} is a verl class and verl is not installed here; agentloop "
                         f"reads these verl tools: {known}; for another, write an agentloop_tools.base.BaseTool "
                         "subclass and name it")
    if spec.ours is None and spec.kind != "mcp":
        raise ValueError(f"{where}.class_name: {name!r} has no agentloop counterpart: {spec.note}")
    out = dict(entry)
    config = dict(out.get("config") or {})
    notices = []
    for key, value in list(config.items()):
        if key in spec.renamed:
            config[spec.renamed[key]] = config.pop(key)
            notices.append(f"{where}: verl tool config {key} read as {spec.renamed[key]}")
        elif key in spec.dropped:
            del config[key]
            notices.append(f"{where}: verl tool config {key} ignored ({spec.dropped[key]})")
        elif key in spec.only:
            allowed, why = spec.only[key]
            if value != allowed:
                raise ValueError(f"{where}.config.{key}={value!r} is not supported: {why}")
            del config[key]
    config["type"] = spec.kind
    out["config"] = config
    if spec.kind == "mcp":
        out.pop("class_name")
        notices.insert(0, f"{where}: verl tool {name} read as an MCP entry ({spec.note})")
    else:
        out["class_name"] = spec.ours
        notices.insert(0, f"{where}: verl tool {name} read as {spec.ours} ({spec.note})")
    return out, notices
