"""The API reference pages, one per package, generated at build time (an mkdocs hook).

Each page renders the package's public surface (its ``__all__``) with mkdocstrings, then that of
each public subpackage (the trainer's ``config``, ``data``, ``reward``...), found by walking the
package, so a subpackage added later gets its section without anyone listing it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

PACKAGES: dict[str, str] = {
    "agentloop_core": "agentloop-core",
    "agentloop_engines": "agentloop-engines",
    "agentloop_tools": "agentloop-tools",
    "agentloop_trainer": "agentloop-trainer",
    "agentloop_langgraph": "agentloop-langgraph",
    "agentloop_conformance": "agentloop-conformance",
}
"""Import name -> distribution name of every package the reference covers."""


def page_path(module: str) -> str:
    """Where a package's reference page lives in the site."""
    return f"api/{PACKAGES[module]}.md"


def public_subpackages(module: str) -> list[str]:
    """The subpackages of ``module`` that declare a public surface (an ``__all__``), sorted."""
    package = importlib.import_module(module)
    out = []
    for info in pkgutil.iter_modules(package.__path__, module + "."):
        if not info.ispkg or info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        if hasattr(importlib.import_module(info.name), "__all__"):
            out.append(info.name)
    return sorted(out)


def render(module: str) -> str:
    """The Markdown of one package's page: mkdocstrings directives over its public modules."""
    lines = [f"# {PACKAGES[module]}", "", f"::: {module}", "    options:", "      show_root_heading: false", ""]
    for sub in public_subpackages(module) if module == "agentloop_trainer" else []:
        lines += [f"## `{sub}`", "", f"::: {sub}", "    options:", "      show_root_heading: false",
                  "      heading_level: 3", ""]
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add one generated reference page per package."""
    from mkdocs.structure.files import File

    for module in PACKAGES:
        files.append(File.generated(config, page_path(module), content=render(module)))
    return files
