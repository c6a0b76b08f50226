"""The house limit on module size: every source module of every package under 500 lines.

Run by ``nox -s lint``; prints each module over the limit (largest first) and exits 1 when
there is one, so a module that grows past it is split in the change that grows it.

    python tools/module_sizes.py [--limit 500] [--warn 450]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_sizes(root: Path = ROOT) -> list[tuple[int, Path]]:
    """``(lines, path)`` of every ``.py`` file under ``packages/*/src``, largest first."""
    sizes = [(len(p.read_text(encoding="utf-8").splitlines()), p) for p in sorted(root.glob("packages/*/src/**/*.py"))]
    return sorted(sizes, key=lambda s: (-s[0], str(s[1])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=500, help="fail on a module with more lines than this")
    parser.add_argument("--warn", type=int, default=450, help="list modules with more lines than this")
    args = parser.parse_args(argv)
    sizes = module_sizes()
    over = [(n, p) for n, p in sizes if n > args.limit]
    near = [(n, p) for n, p in sizes if args.warn < n <= args.limit]
    for n, p in near:
        print(f"near the limit: {n:4d} lines  {p.relative_to(ROOT)}")
    for n, p in over:
        print(f"OVER {args.limit}: {n:4d} lines  {p.relative_to(ROOT)} (split it into modules of one idea)")
    print(f"{len(sizes)} source modules; {len(over)} over {args.limit} lines, {len(near)} over {args.warn}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
