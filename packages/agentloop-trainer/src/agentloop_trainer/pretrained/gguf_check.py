"""Check a GGUF file against itself before anything is allocated from what it declares.

A GGUF is a header (metadata and tensor descriptions) followed by tensor data, and every reader
trusts the header: the gguf package loops over whatever array length it declares (an array that
runs past the end of the file grows a list without end), transformers builds the model from the
metadata's sizes and only then finds that the tensors do not fit (a 120 KB file declaring a
hidden size of 2048 costs 770 MB before a raw ``RuntimeError``; one declaring 64 layers where it
holds 2 converts "successfully", 62 of them random). So two checks run first:

1. :func:`check_gguf_layout` walks the header with every count held against the bytes left, and
   every tensor's type, shape, alignment and data range against the file (ranges may not overlap,
   so the tensors' total size is at most the file's);
2. :func:`check_config_against_tensors` builds the model transformers would build on the ``meta``
   device (no memory) and holds each weight's size against the tensor the file holds for it.

Both raise :class:`ConversionError` naming the problem and the fix.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConversionError(RuntimeError):
    """A GGUF that cannot be converted, a folder in the way, or a conversion that failed its check."""


MAX_METADATA_ITEMS = 1 << 22
"""Most array elements the metadata may hold in all (the gguf reader keeps a few hundred bytes of
Python objects per element; real models hold under a million: tokens, merges, token types)."""
MAX_ARRAY_NESTING = 4
"""Arrays of arrays deeper than this are refused (the reader recurses per level)."""
GGML_MAX_DIMS = 4
"""llama.cpp's own limit on a tensor's dimensions."""
DEFAULT_ALIGNMENT = 32

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF value types by id: uint8, int8, uint16, int16, uint32, int32, float32, bool, uint64,
int64, float64. 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9
_REFETCH = "re-download the file (and compare its sha256 with the publisher's) or re-create it with llama.cpp"


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as the header describes it, checked against the file."""

    name: str
    """The GGUF tensor name (``blk.0.attn_q.weight``)."""
    shape: tuple[int, ...]
    """Dimensions in GGUF order (fastest-varying first)."""
    type_name: str
    """ggml's name of its storage type (``F32``, ``Q4_K``...)."""
    n_elements: int
    """Values it holds once dequantized."""
    n_bytes: int
    """Bytes it takes in the file."""


class _Header:
    """A cursor over the file's bytes that refuses to read past the end."""

    def __init__(self, data: Any, name: str) -> None:
        self.data, self.name, self.pos, self.endian = data, name, 0, "<"

    def fail(self, problem: str) -> ConversionError:
        return ConversionError(f"{self.name} is not a well-formed GGUF file: {problem}; {_REFETCH}")

    def take(self, n: int, what: str) -> bytes:
        left = len(self.data) - self.pos
        if n > left:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has {left} left (truncated?)")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "little" if self.endian == "<" else "big")

    def string(self, what: str) -> str:
        length = self.uint(8, f"the length of {what}")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.pos - length} is not UTF-8") from None

    def skip_value(self, value_type: int, key: str, budget: list[int], depth: int = 0) -> None:
        """Skip one value, checking that every array's declared length fits in the bytes left."""
        if value_type in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[value_type], f"the value of {key!r}")
        elif value_type == _STRING:
            self.string(f"the value of {key!r}")
        elif value_type == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise self.fail(f"{key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
            item_type = self.uint(4, f"the item type of {key!r}")
            count = self.uint(8, f"the length of {key!r}")
            if item_type not in _SCALAR_SIZES and item_type not in (_STRING, _ARRAY):
                raise self.fail(f"{key!r} is an array of unknown type {item_type}")
            smallest = _SCALAR_SIZES.get(item_type, 8 if item_type == _STRING else 12)
            left = len(self.data) - self.pos
            if count * smallest > left:
                raise self.fail(f"{key!r} declares {count:,} items (at least {count * smallest:,} bytes), the file "
                                f"has {left:,} bytes left")
            budget[0] -= count
            if budget[0] < 0:
                raise self.fail(f"the metadata holds more than {MAX_METADATA_ITEMS:,} array items ({key!r} "
                                f"declares {count:,})")
            if item_type in _SCALAR_SIZES:
                self.take(count * smallest, f"the items of {key!r}")
            else:
                for _ in range(count):
                    self.skip_value(item_type, key, budget, depth + 1)
        else:
            raise self.fail(f"{key!r} has unknown value type {value_type}")


def check_gguf_layout(path: str | Path) -> list[TensorRecord]:
    """Walk the header of the GGUF at ``path`` and check every tensor against the file.

    Nothing is allocated from a declared size: the file is memory-mapped, and a count is used
    only after it was held against the bytes that could hold it.

    Returns:
        The tensors, in the header's order.

    Raises:
        ConversionError: the header runs past the end of the file, declares more items than
            :data:`MAX_METADATA_ITEMS`, an unknown type, a tensor of more than 4 dimensions or
            with a zero or overflowing dimension, a misaligned tensor, a tensor whose data lies
            past the end of the file, or two tensors sharing bytes.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with path.open("rb") as f:
        size = path.stat().st_size
        if size == 0:
            raise ConversionError(f"{path.name} is empty, not a GGUF file; {_REFETCH}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            h = _Header(data, path.name)
            if h.take(4, "the magic") != b"GGUF":
                raise h.fail("it does not start with 'GGUF'")
            version = h.uint(4, "the version")
            if version & 0xFFFF == 0:  # written on a big-endian machine
                h.endian, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
            if version not in (2, 3):
                raise h.fail(f"version {version} (this reader knows 2 and 3)")
            n_tensors = h.uint(8, "the tensor count")
            n_kv = h.uint(8, "the metadata count")
            left = size - h.pos
            if n_kv * 13 > left or n_tensors * 24 > left:  # the smallest entries a header can hold
                raise h.fail(f"it declares {n_kv:,} metadata entries and {n_tensors:,} tensors, more than "
                             f"{left:,} bytes can hold")
            budget = [MAX_METADATA_ITEMS]
            alignment = DEFAULT_ALIGNMENT
            keys: set[str] = set()
            for _ in range(n_kv):
                key = h.string("a metadata key")
                if key in keys:
                    raise h.fail(f"metadata key {key!r} appears twice")
                keys.add(key)
                value_type = h.uint(4, f"the type of {key!r}")
                start = h.pos
                h.skip_value(value_type, key, budget)
                if key == "general.alignment":
                    if value_type != 4:
                        raise h.fail("general.alignment is not a uint32")
                    alignment = int.from_bytes(data[start:start + 4], "little" if h.endian == "<" else "big")
                    if alignment == 0 or alignment & (alignment - 1):
                        raise h.fail(f"general.alignment {alignment} is not a power of two")
            infos = []
            for _ in range(n_tensors):
                name = h.string("a tensor name")
                n_dims = h.uint(4, f"the dimension count of tensor {name!r}")
                if not 1 <= n_dims <= GGML_MAX_DIMS:
                    raise h.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {GGML_MAX_DIMS} allowed)")
                shape = tuple(h.uint(8, f"a dimension of tensor {name!r}") for _ in range(n_dims))
                type_id = h.uint(4, f"the type of tensor {name!r}")
                offset = h.uint(8, f"the data offset of tensor {name!r}")
                infos.append((name, shape, type_id, offset))
            data_start = -(-h.pos // alignment) * alignment
    seen: set[str] = set()
    tensors: list[TensorRecord] = []
    ranges: list[tuple[int, int, str]] = []
    for name, shape, type_id, offset in infos:
        problem = _tensor_problem(name, shape, type_id, offset, alignment, seen, GGML_QUANT_SIZES, GGMLQuantizationType)
        if problem:
            raise ConversionError(f"{path.name} is not a well-formed GGUF file: {problem}; {_REFETCH}")
        seen.add(name)
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = 1
        for d in shape:
            n_elements *= d
        n_bytes = n_elements // block * type_size
        end = data_start + offset + n_bytes
        if end > size:
            raise ConversionError(
                f"{path.name} is not a well-formed GGUF file: tensor {name!r} ({qtype.name}, shape {list(shape)}) "
                f"declares {n_bytes:,} bytes at byte {data_start + offset:,}, past the end of the {size:,}-byte file "
                f"(truncated, or its header lies); {_REFETCH}")
        ranges.append((data_start + offset, end, name))
        tensors.append(TensorRecord(name, shape, qtype.name, n_elements, n_bytes))
    ranges.sort()
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:], strict=False):
        if start < end:
            raise ConversionError(f"{path.name} is not a well-formed GGUF file: tensors {first!r} and {second!r} "
                                  f"share bytes (a file may not hold one tensor's data twice); {_REFETCH}")
    return tensors


def _tensor_problem(name: str, shape: tuple[int, ...], type_id: int, offset: int, alignment: int, seen: set[str],
                    sizes: Any, types: Any) -> str | None:
    if name in seen:
        return f"tensor {name!r} appears twice"
    try:
        qtype = types(type_id)
    except ValueError:
        return f"tensor {name!r} has unknown type {type_id}"
    if qtype not in sizes:
        return f"tensor {name!r} has type {qtype.name}, which has no known size"
    if any(d == 0 for d in shape):
        return f"tensor {name!r} has a zero dimension ({list(shape)})"
    n_elements = 1
    for d in shape:
        n_elements *= d
    if n_elements >= 1 << 63:
        return f"tensor {name!r} declares {list(shape)}: more values than any file holds"
    block = sizes[qtype][0]
    if shape[0] % block:
        return f"tensor {name!r} ({qtype.name}) has a first dimension {shape[0]} that is not a multiple of {block}"
    if offset % alignment:
        return f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}"
    return None


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def check_config_against_tensors(path: str | Path, tensors: list[TensorRecord]) -> tuple[Any, int]:
    """Check the model the metadata describes against the tensors the file holds.

    The model is built on the ``meta`` device (shapes only), after its layer count was held
    against the ``blk.N`` tensors present, so absurd sizes cost nothing.

    Returns:
        The transformers config and the model's parameter count.

    Raises:
        ConversionError: transformers cannot read the metadata, the layer count differs from the
            layers whose tensors are present, a weight's size differs from its tensor's, or the model
            has weights the file does not hold (transformers would fill them with random values).
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, IndexError, TypeError, NotImplementedError, OSError) as exc:
        raise ConversionError(f"transformers {transformers.__version__} cannot read the metadata of {path.name}: "
                              f"{exc}") from None
    fix = (f"the metadata of {path.name} does not describe its tensors (a damaged or badly written file): "
           f"{_REFETCH}")
    blocks = {int(m.group(1)) for t in tensors if (m := _BLOCK.match(t.name))}
    layers = getattr(config, "num_hidden_layers", None)
    if blocks and isinstance(layers, int) and layers != max(blocks) + 1:
        raise ConversionError(f"{path.name} declares {layers} layers (block_count) but holds tensors for "
                              f"{max(blocks) + 1}; {fix}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        processor = TENSOR_PROCESSORS.get(config.model_type, TensorProcessor)(config=config.to_dict())
        name_map = get_gguf_hf_weights_map(model, processor)
    except (ValueError, KeyError, IndexError, TypeError, NotImplementedError, RuntimeError) as exc:
        raise ConversionError(f"transformers {transformers.__version__} cannot build a model from the metadata of "
                              f"{path.name} (architecture {getattr(config, 'model_type', '?')!r}): {exc}") from None
    params = dict(model.named_parameters())  # tied weights once
    held: dict[str, int] = {}
    for t in tensors:
        hf_name = name_map.get(t.name)
        if hf_name is not None:
            held[hf_name] = held.get(hf_name, 0) + t.n_elements
    for hf_name, n in held.items():
        p = params.get(hf_name)
        if p is not None and p.numel() != n:
            gguf_names = [t.name for t in tensors if name_map.get(t.name) == hf_name]
            sizes = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                     "num_attention_heads", "num_key_value_heads")
                     if isinstance(getattr(config, k, None), int)}
            raise ConversionError(
                f"{path.name}: tensor {', '.join(gguf_names)} holds {n:,} values, but the metadata ({sizes}) makes "
                f"{hf_name} {list(p.shape)} ({p.numel():,} values); {fix}")
    expected = sum(p.numel() for p in params.values())
    present = sum(t.n_elements for t in tensors)
    if expected > present:
        missing = [n for n in params if n not in held]
        raise ConversionError(
            f"{path.name}: the metadata describes a model of {expected:,} parameters, the file holds {present:,} "
            f"values; weights without a tensor (transformers would fill them with random values): {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; {fix}")
    return config, expected
