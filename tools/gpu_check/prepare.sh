#!/usr/bin/env bash
# Prepare the GPU check (tools/gpu_check/run.py) for one device call. Run it HERE, on the
# machine without a GPU, from anywhere in the repo:
#
#   bash tools/gpu_check/prepare.sh
#
# It downloads the wheels the device machine lacks (tools/gpu_check/wheels.txt: Python 3.12,
# x86-64; the device has no package index) into .whl/gpu-check/ (git-ignored by .gitignore's
# `.whl/`), removes any other file there, and prints the one device call to make:
#
#   run(command="PYTHONUNBUFFERED=1 python3 tools/gpu_check/run.py",
#       carry=[".whl/gpu-check"], timeout_s=540)
#
# (add `--model DIR_OR_GGUF` to the command, and the path to carry, for the real-model step;
# a converted SmolLM2 folder is 538 MB and its GGUF 93 MB, over the 64 MiB a call carries, so
# without one that step is recorded as skipped with the reason). The result comes back as
# $OUT/gpu_check.json: read it under the reply's files_at. README.md, "A GPU check in one
# command", says more.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="$root/.whl/gpu-check"
python="${PYTHON:-python3}"
mapfile -t wheels < <(grep -v '^\s*\(#\|$\)' "$root/tools/gpu_check/wheels.txt")

if ! grep -qx '\.whl/\?' "$root/.gitignore"; then
    echo "prepare.sh: .whl/ is not in $root/.gitignore: add the line '.whl/' (the wheels would travel" \
         "as part of the working tree and could be committed)" >&2
    exit 1
fi
mkdir -p "$dest"
find "$dest" -mindepth 1 -delete
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "${wheels[@]}"

count=$(find "$dest" -name '*.whl' | wc -l)
if [ "$count" -ne "${#wheels[@]}" ]; then
    echo "prepare.sh: expected ${#wheels[@]} wheels in $dest, found $count: check wheels.txt" >&2
    exit 1
fi
size=$(du -sh "$dest" | cut -f1)
cat <<EOF
prepare.sh: $count wheels ($size) in $dest

The device call (one run; the check stops itself before 8 minutes):
  command:   PYTHONUNBUFFERED=1 python3 tools/gpu_check/run.py
  carry:     [".whl/gpu-check"]
  timeout_s: 540
Then read gpu_check.json under the reply's files_at (status, then each step's status,
reason, numbers and tail), and give the machine back unless you rerun at once.
EOF
