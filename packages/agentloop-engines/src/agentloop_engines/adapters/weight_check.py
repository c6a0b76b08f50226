"""Checking a weight update against the model before any of it is loaded.

An update is a list of ``(name, tensor)`` pairs, and engines load them one after another: a
loader that checks each pair as it copies it has already changed every tensor before the first
bad one (a misspelt name, a transposed matrix), leaving a model that is neither the old policy
nor the new one, with nothing to tell the trainer which. So every engine runs
:func:`check_weight_update` on the whole update first, against what it knows of its model
(:class:`WeightSpec` per name: HFServer's own ``state_dict``, the checkpoint's safetensors
headers for vLLM and SGLang, whose parameters are fused or sharded), and loads nothing unless
every pair passes.

Torch is not imported here: shapes and dtypes are read from the values' attributes, so the
SGLang adapter (tested against a stand-in without a model) can use it too.
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WeightSpec", "WeightUpdateError", "check_weight_update", "checkpoint_weight_specs", "dtype_kind"]

_MAX_LISTED = 10
"""Problems named in one error; the rest are counted."""
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
"""Name endings of an input embedding, whose shape a tied ``lm_head.weight`` has."""


class WeightUpdateError(ValueError, KeyError):
    """A weight update that does not fit the model; nothing of it was loaded.

    A ``ValueError`` (bad input: the HTTP server answers 400) and, for callers written against
    the older per-tensor errors, a ``KeyError``.
    """

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class WeightSpec:
    """What the model holds under one name."""

    shape: tuple[int, ...] | None
    """The tensor's shape; None: unknown (only the name is checked)."""
    kind: str | None
    """``float``, ``int``, ``bool`` or ``complex`` (see :func:`dtype_kind`); None: unknown."""


def dtype_kind(dtype: Any) -> str | None:
    """The kind of a torch or numpy dtype, a safetensors dtype string (``F32``, ``BF16``,
    ``I64``, ``BOOL``) or a Python scalar type: ``float``, ``int``, ``bool``, ``complex``, or None.

    A weight may be cast within its kind (float32 to bfloat16: engines run in their own
    precision), never across kinds: an integer tensor for a float weight is a mix-up, not a cast.
    """
    if isinstance(dtype, type) and dtype in (bool, int, float, complex):
        return dtype.__name__
    text = str(dtype).lower().removeprefix("torch.")
    if text == "bool":
        return "bool"
    if text.startswith("complex") or text.startswith("c"):
        return "complex"
    if text.startswith(("float", "bfloat", "half", "double", "f", "bf")):
        return "float"
    if text.startswith(("int", "uint", "long", "short", "i", "u")):
        return "int"
    return None


def _describe(value: Any) -> tuple[tuple[int, ...] | None, str | None, str]:
    """``(shape, kind, what)`` of a value in an update (a tensor, array or Python scalar)."""
    if isinstance(value, (bool, int, float, complex)):
        return (), dtype_kind(type(value)), type(value).__name__
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None, None, type(value).__name__
    return tuple(int(d) for d in shape), dtype_kind(dtype), str(dtype).removeprefix("torch.")


def check_weight_update(items: Iterable[tuple[str, Any]], specs: Mapping[str, WeightSpec], *,
                        engine: str = "the model") -> list[tuple[str, Any]]:
    """Check a whole update before any of it is loaded; return its pairs as a list.

    Every name must be one of ``specs``; every value must be a tensor (or a Python scalar for
    a 0-d weight) of the spec's shape and dtype kind.

    Args:
        items: The ``(name, tensor)`` pairs (consumed once).
        specs: What the model holds, by name.
        engine: Who is loading, for the message (``HFServer``).

    Raises:
        WeightUpdateError: naming every bad tensor (the first ten) and what is wrong with it,
            with the closest known name for an unknown one.
    """
    pairs = [(str(name), value) for name, value in items]
    problems: list[str] = []
    for name, value in pairs:
        spec = specs.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, list(specs), n=3)
            problems.append(f"no weight named {name!r}"
                            + (f" (did you mean {close[0]!r}?); closest names: {close}" if close else ""))
            continue
        shape, kind, what = _describe(value)
        if shape is None:
            problems.append(f"{name!r} is a {what}, not a tensor")
        elif spec.shape is not None and shape != spec.shape:
            problems.append(f"{name!r} has shape {shape}, the model expects {spec.shape}")
        elif spec.kind is not None and kind != spec.kind:
            problems.append(f"{name!r} has dtype {what} ({kind}), the model holds a {spec.kind} tensor")
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise WeightUpdateError(
            f"update_weights: {len(problems)} of {len(pairs)} tensors do not fit {engine}, so nothing was "
            f"loaded: {'; '.join(problems[:_MAX_LISTED])}{more}. Send the model's own names (strip wrapper "
            "prefixes such as 'module.' or '_orig_mod.'), shapes and a floating dtype for floating weights")
    return pairs


def checkpoint_weight_specs(folder: str | Path) -> dict[str, WeightSpec] | None:
    """The tensors of a safetensors checkpoint folder (what vLLM's and SGLang's loaders accept),
    read from the files' headers (no tensor is read), or None when there are none to read (no
    folder, no safetensors, Git LFS pointers).

    A tied checkpoint has no ``lm_head.weight``, but a trainer's ``state_dict`` does: it is
    added with the input embedding's spec (the loaders skip or tie it).
    """
    folder = Path(folder)
    index, config = folder / "model.safetensors.index.json", folder / "config.json"
    specs: dict[str, WeightSpec] = {}
    try:
        if index.is_file():
            # The index alone names the weights; a shard it cannot read leaves only their names.
            weight_map = json.loads(index.read_text())["weight_map"]
            specs.update(dict.fromkeys(weight_map, WeightSpec(None, None)))
            for file in sorted({folder / f for f in weight_map.values()}):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError, OverflowError, MemoryError):
                    specs.update(_header_specs(file))
        else:
            for file in sorted(folder.glob("*.safetensors")):
                specs.update(_header_specs(file))
        if specs and config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
            embedding = next((s for n, s in specs.items() if n.endswith(_EMBEDDINGS)), WeightSpec(None, None))
            specs.setdefault("lm_head.weight", embedding)
    except (OSError, ValueError, KeyError, TypeError, OverflowError, MemoryError):  # e.g. Git LFS pointer files
        return None
    return specs or None


def _header_specs(file: Path) -> dict[str, WeightSpec]:
    with file.open("rb") as fh:  # an 8-byte little-endian header size, then a JSON header
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    return {name: WeightSpec(tuple(int(d) for d in entry["shape"]), dtype_kind(entry["dtype"]))
            for name, entry in header.items() if name != "__metadata__"}
