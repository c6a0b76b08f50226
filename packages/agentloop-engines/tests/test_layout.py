"""The package's rooms and the direction of their imports (see the README's "Layout").

``serving`` may import ``fleet`` (the gateway answers the router's errors), both may import the
root modules (``base``, ``streaming``, ``wire``, ``plugins``), ``adapters`` only the root; no room
imports ``cli``, which composes them. An arrow the other way is a two-way tie between rooms in
the making: move the shared piece down (to the root) instead. Imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import agentloop_engines
from agentloop_core.engine_registry import engine_names, get_engine_plugin

SRC = Path(agentloop_engines.__file__).parent
ROOMS = ("adapters", "serving", "fleet", "testing", "wire")
ALLOWED = {
    "adapters": {"root"},
    "wire": {"root"},
    "fleet": {"root", "wire"},
    "serving": {"root", "wire", "fleet"},
    "testing": {"root", "adapters"},
    "root": {"root", "wire", "adapters", "serving", "fleet", "testing"},  # __init__ re-exports; cli composes
}


def _room(module: str) -> str:
    """The room of a dotted module under ``agentloop_engines`` (``root`` for the top-level modules)."""
    parts = module.split(".")[1:]
    return parts[0] if parts and parts[0] in ROOMS else "root"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m == "agentloop_engines" or m.startswith("agentloop_engines.")}


def test_imports_between_rooms_run_one_way():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(("agentloop_engines", *path.relative_to(SRC).with_suffix("").parts))
        room = _room(module)
        for imported in _imports(path):
            if imported == "agentloop_engines.cli" and module != "agentloop_engines.cli":
                wrong.append(f"{module} imports agentloop_engines.cli")
            elif _room(imported) not in ALLOWED[room] | {room}:
                wrong.append(f"{module} ({room}) imports {imported} ({_room(imported)})")
    assert wrong == []


def test_each_engine_is_an_adapters_subpackage_with_its_server_module():
    for name in ("hf", "vllm", "sglang"):
        assert name in engine_names()
        factory_module = get_engine_plugin(name).factory.partition(":")[0]
        assert factory_module == f"agentloop_engines.adapters.{name}.server"
        assert (SRC / "adapters" / name / "server.py").is_file()
        assert (SRC / "adapters" / name / "__init__.py").is_file()
