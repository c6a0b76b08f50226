"""Check that every in-repo dependency range admits the sibling's version in this repo.

Run by ``nox -s versions``. Exits non-zero naming each package whose range excludes a sibling.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    projects = {}
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("conformance/pyproject.toml")]):
        data = tomllib.loads(pyproject.read_text())["project"]
        projects[canonicalize_name(data["name"])] = (pyproject, data)
    problems = []
    checked = 0
    for pyproject, data in projects.values():
        deps = list(data.get("dependencies", []))
        for extra in data.get("optional-dependencies", {}).values():
            deps += extra
        for dep in deps:
            req = Requirement(dep)
            sibling = projects.get(canonicalize_name(req.name))
            if sibling is None:
                continue
            checked += 1
            version = sibling[1]["version"]
            if not req.specifier.contains(version, prereleases=True):
                problems.append(
                    f"{pyproject.relative_to(ROOT)}: {dep!r} excludes {req.name} {version} in this repo; "
                    f"widen the range or bump {req.name}"
                )
            if not str(req.specifier):
                problems.append(f"{pyproject.relative_to(ROOT)}: {dep!r} has no version range; use '>=x.y,<x+1'")
    for p in problems:
        print(p)
    print(f"checked {checked} sibling ranges across {len(projects)} packages: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
