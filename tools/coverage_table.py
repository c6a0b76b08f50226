"""Print the combined coverage of each package's src and of all of them; exit 1 below the floor.

    python tools/coverage_table.py .coverage-data/.coverage

The floor is ``[tool.coverage.report] fail_under`` in pyproject.toml: the figure measured when
it was set, so a change that removes tests (or adds untested code) shows up as a red CI.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent
SRC = {
    "agentloop-core": "packages/agentloop-core/src/*",
    "agentloop-engines": "packages/agentloop-engines/src/*",
    "agentloop-tools": "packages/agentloop-tools/src/*",
    "agentloop-trainer": "packages/agentloop-trainer/src/*",
    "agentloop-langgraph": "packages/agentloop-langgraph/src/*",
    "conformance": "conformance/src/*",
}


def main(data_file: str) -> int:
    cov = coverage.Coverage(data_file=data_file, config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    rows = []
    for name, pattern in SRC.items():
        try:
            rows.append((name, cov.report(include=[pattern], file=io.StringIO())))
        except coverage.exceptions.NoDataError:
            rows.append((name, None))
    total = cov.report(file=io.StringIO())
    floor = float(cov.config.fail_under or 0)
    print("| package | line coverage |\n| --- | --- |")
    for name, pct in rows:
        print(f"| {name} | {'no data' if pct is None else f'{pct:.1f}%'} |")
    print(f"| **all** | **{total:.1f}%** |")
    print(f"floor (pyproject.toml [tool.coverage.report] fail_under): {floor:.1f}%")
    if total + 1e-9 < floor:
        print(f"coverage {total:.1f}% is below the floor {floor:.1f}%: add tests for the new code, or lower "
              "fail_under in the same change with the reason in its message", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
