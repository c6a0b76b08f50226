"""Step (b) of the GPU check: install what the device image lacks, touching none of its own
packages. The carried wheels (tools/gpu_check/prepare.sh) go into ``--site`` (``pip install
--target``); our packages go in editable, with no dependencies and no build isolation (hatchling
comes from ``--site``), into ``--editable``. Both with ``pip install --target``, so their
folders are known before the install runs, whatever install scheme the interpreter has. The
check then puts ``--site``, ``--editable`` (the packages' metadata and entry points) and their
``src`` folders (what the editable ``.pth`` files there would add, were it a site folder) on
``PYTHONPATH`` for the steps after this one.

    python tools/gpu_check/install_packages.py --wheels .whl/gpu-check --site W/site --editable W/editable

Prints one ``GPU_CHECK_NUMBERS {json}`` line (what was installed); exits non-zero with pip's
own error when an install fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agentloop-core", "agentloop-engines", "agentloop-tools", "agentloop-trainer")
"""What the check runs: the engines' gpu tests, HFServer and `agentloop train` (trainer)."""


def python_path(site: Path, editable: Path, root: Path = ROOT) -> list[str]:
    """The ``PYTHONPATH`` entries the steps after the install need, in order."""
    return [str(site), str(editable), *(str(root / "packages" / p / "src") for p in PACKAGES)]


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder of carried wheels (prepare.sh)")
    parser.add_argument("--site", type=Path, required=True, help="where the wheels go (pip --target)")
    parser.add_argument("--editable", type=Path, required=True, help="where our editable packages go (pip --target)")
    args = parser.parse_args(argv)
    wheels = sorted(str(w) for w in args.wheels.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {args.wheels}: run `bash tools/gpu_check/prepare.sh` here first and carry "
              f"{args.wheels} in the device call", file=sys.stderr)
        return 2
    quiet = ["-q", "--no-index", "--no-deps", "--no-cache-dir", "--disable-pip-version-check"]
    pip("install", *quiet, "--no-compile", "--upgrade", "--target", str(args.site), *wheels)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(args.site), os.environ.get("PYTHONPATH")]))}
    editable = [a for p in PACKAGES for a in ("-e", str(ROOT / "packages" / p))]
    pip("install", *quiet, "--no-build-isolation", "--upgrade", "--target", str(args.editable), *editable, env=env)
    numbers = {"wheels": [Path(w).name for w in wheels], "editable": list(PACKAGES),
               "pythonpath": python_path(args.site, args.editable)}
    print("GPU_CHECK_NUMBERS " + json.dumps(numbers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
