"""Hostile model files and configs: a GGUF whose header or metadata lies about its tensors is
refused with :class:`ConversionError` before anything is allocated from what it declares, and a
malformed ``--config`` YAML is one line naming the file, line and column.

How to debug a failure: run ``agentloop model convert <file> --out /tmp/x`` on the file the test
writes (``tmp_path``); the checks live in ``agentloop_trainer/pretrained/gguf_check.py``
(``check_gguf_layout`` for the header, ``check_config_against_tensors`` for the metadata).
A raw ``ValueError``/``IndexError``/``RuntimeError`` means a check was skipped and the gguf
reader or transformers met the lie first.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("agentloop_trainer.pretrained", reason="agentloop-trainer is not installed")
gguf = pytest.importorskip("gguf", reason='GGUF checks need gguf: pip install "agentloop-trainer[gguf]"')
pytest.importorskip("accelerate", reason='GGUF conversion needs accelerate: pip install "agentloop-trainer[gguf]"')

from agentloop_trainer.pretrained import ConversionError, convert_gguf  # noqa: E402

# ---- raw GGUF files: every byte of the header chosen here -------------------------------------

U8, U32, STR, ARR = 0, 4, 8, 9
F32 = 0  # ggml type id


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _raw_gguf(path: Path, kvs: bytes = b"", n_kv: int = 0, tensors: Sequence[tuple] = (), n_tensors: int | None = None,
              data: bytes = b"", tail: bytes = b"") -> Path:
    """A GGUF v3 file: ``kvs`` already encoded, ``tensors`` as (name, dims, type, offset); the
    counts may lie (``n_tensors``); ``data`` is placed at the aligned data start."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, n_kv) + kvs
    for name, dims, ggml_type, offset in tensors:
        head += _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", ggml_type, offset)
    head += tail
    pad = -len(head) % 32
    path.write_bytes(head + b"\0" * pad + data)
    return path


def _kv_arch() -> bytes:
    return _str("general.architecture") + struct.pack("<I", STR) + _str("llama")


HEADER_LIES = {
    # id: (kvs, n_kv, tensors, n_tensors, data, what the error must name)
    "uint8 array of 2**40 items": (_kv_arch() + _str("tokenizer.ggml.token_type") + struct.pack("<IIQ", ARR, U8, 1 << 40),
                                   2, [], None, b"", "declares 1,099,511,627,776 items"),
    "string array of 2**32 items": (_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARR, STR, 1 << 32), 1, [], None,
                                    b"", "declares 4,294,967,296 items"),
    "a string longer than the file": (_str("general.name") + struct.pack("<IQ", STR, 1 << 50), 1, [], None, b"",
                                      "the value of 'general.name'"),
    "2**40 tensors": (_kv_arch(), 1, [], 1 << 40, b"", "1,099,511,627,776 tensors"),
    "2**40 metadata entries": (b"", 1 << 40, [], None, b"", "1,099,511,627,776 metadata entries"),
    "tensor data past the end": (_kv_arch(), 1, [("token_embd.weight", (1 << 20, 1 << 14), F32, 0)], None,
                                 b"\0" * 64, "past the end"),
    "tensors sharing bytes": (_kv_arch(), 1, [(f"blk.{i}.ffn_up.weight", (8, 8), F32, 0) for i in range(64)], None,
                              b"\0" * 256, "share bytes"),
    "a tensor of 5 dimensions": (_kv_arch(), 1, [("t", (1, 1, 1, 1, 1), F32, 0)], None, b"\0" * 32, "5 dimensions"),
    "an overflowing shape": (_kv_arch(), 1, [("t", (1 << 32, 1 << 32), F32, 0)], None, b"\0" * 32,
                             "more values than any file holds"),
    "an unknown tensor type": (_kv_arch(), 1, [("t", (8,), 9999, 0)], None, b"\0" * 32, "unknown type 9999"),
    "a misaligned tensor": (_kv_arch(), 1, [("t", (8,), F32, 3)], None, b"\0" * 64, "not a multiple of the alignment"),
    "a duplicate tensor": (_kv_arch(), 1, [("t", (8,), F32, 0), ("t", (8,), F32, 32)], None, b"\0" * 64,
                           "appears twice"),
}


@pytest.mark.parametrize("case", list(HEADER_LIES))
def test_a_gguf_header_that_lies_is_refused_before_anything_is_allocated(tmp_path, case):
    """Each file is under 1 KB and its header declares something the file cannot hold (arrays
    of 2**40 items, data past the end, tensors aliasing one range). The conversion must raise
    ConversionError naming the lie, allocate under 5 MB doing so (the gguf reader loops over a
    declared array length, growing a list per item), and leave nothing at --out."""
    kvs, n_kv, tensors, n_tensors, data, expected = HEADER_LIES[case]
    path = _raw_gguf(tmp_path / "hostile.gguf", kvs, n_kv, tensors, n_tensors, data)
    out = tmp_path / "out"
    tracemalloc.start()
    try:
        with pytest.raises(ConversionError, match="not a well-formed GGUF") as caught:
            convert_gguf(path, out, log=lambda _: None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert expected in str(caught.value)
    assert "re-download" in str(caught.value)  # the fix
    assert peak < 5 << 20, f"{peak / 1e6:.1f} MB allocated checking a {path.stat().st_size}-byte file"
    assert not out.exists()


def test_a_truncated_gguf_is_refused_naming_the_truncation(tmp_path):
    """A real (tiny) GGUF cut in the middle of its tensor data: ConversionError, 'past the end'."""
    path = _tiny_llama(tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(ConversionError, match="past the end"):
        convert_gguf(cut, tmp_path / "out", log=lambda _: None)


# ---- metadata that does not fit the tensors ----------------------------------------------------

HIDDEN, FF, LAYERS, VOCAB, HEADS, KV_HEADS = 32, 64, 2, 300, 4, 2


def _tiny_llama(path: Path, **declared: int) -> Path:
    """A tiny Llama GGUF (random weights, a trivial vocabulary) whose metadata may declare other
    sizes than its tensors have: ``hidden``, ``ff``, ``layers``, ``vocab``."""
    import numpy as np

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(declared.get("hidden", HIDDEN))
    w.add_block_count(declared.get("layers", LAYERS))
    w.add_feed_forward_length(declared.get("ff", FF))
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(declared.get("vocab", VOCAB))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_merges([])

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    t("token_embd.weight", VOCAB, HIDDEN)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        t(f"blk.{i}.attn_norm.weight", HIDDEN)
        t(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        t(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        t(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        t(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        t(f"blk.{i}.ffn_norm.weight", HIDDEN)
        t(f"blk.{i}.ffn_gate.weight", FF, HIDDEN)
        t(f"blk.{i}.ffn_up.weight", FF, HIDDEN)
        t(f"blk.{i}.ffn_down.weight", HIDDEN, FF)
    t("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


METADATA_LIES = {
    # The first asks transformers for 2 layers of hidden 8192 / ffn 32768: 2.1e9 parameters, 8.6 GB
    # of float32, from a 118 KB file (the old code allocated them, then failed with RuntimeError).
    "hidden": ({"hidden": 8192, "ff": 32768}, "hidden_size"),
    # 64 layers where the file holds 2: the old code converted it, 62 layers of random weights.
    "layers": ({"layers": 64}, "declares 64 layers (block_count) but holds tensors for 2"),
    "vocab": ({"vocab": 1_000_000}, "'vocab_size': 1000000"),
}


def test_metadata_that_does_not_fit_the_tensors_is_refused_before_the_model_is_built(tmp_path):
    """Three tiny GGUFs whose metadata declares a hidden size of 8192 (8.6 GB of weights), 64
    layers (2 present) and a vocabulary of 1,000,000 (300 present), converted by the CLI in a
    fresh process: each exits 2 with one ``agentloop model convert:`` line naming the key, and
    the process peaks under 1.5 GB (importing torch and transformers takes ~0.4 GB). A
    traceback, exit 0 or a higher peak means transformers built the model from the metadata."""
    files = {k: str(_tiny_llama(tmp_path / f"{k}.gguf", **sizes)) for k, (sizes, _) in METADATA_LIES.items()}
    script = textwrap.dedent("""
        import contextlib, io, json, resource, sys
        from agentloop_trainer.cli.main import main
        results = {}
        for key, path in json.loads(sys.argv[1]).items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    rc = main(["model", "convert", path, "--out", path + ".out"])
                except BaseException as exc:
                    rc = f"raised {type(exc).__name__}: {exc}"[:500]
            results[key] = [rc, err.getvalue()]
        results["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(results))
    """)
    done = subprocess.run([sys.executable, "-c", script, json.dumps(files)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "AGENTLOOP_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for key, (_, expected) in METADATA_LIES.items():
        rc, err = results[key]
        assert rc == 2, f"{key}: {rc} {err[-2000:]}"
        last = err.strip().splitlines()[-1]
        assert last.startswith("agentloop model convert: "), f"{key}: {err[-2000:]}"
        assert expected in last, f"{key}: {err[-2000:]}"
        assert "Traceback" not in err
        assert not Path(files[key] + ".out").exists()
    assert results["maxrss_kb"] < 1.5 * (1 << 20), f"peak {results['maxrss_kb'] / 1024:.0f} MB"


def test_an_honest_tiny_gguf_passes_both_checks(tmp_path):
    """The same writer without lies: both checks pass and count the parameters (a check that
    refuses honest files would pass every test above)."""
    from agentloop_trainer.pretrained.gguf_check import check_config_against_tensors, check_gguf_layout

    path = _tiny_llama(tmp_path / "honest.gguf")
    tensors = check_gguf_layout(path)
    assert len(tensors) == 2 + 9 * LAYERS
    _, parameters = check_config_against_tensors(path, tensors)
    assert parameters == sum(t.n_elements for t in tensors)


# ---- malformed --config YAML ------------------------------------------------------------------

BAD_YAML = {
    "unclosed flow sequence": ("trainer:\n  total_steps: [1, 2\n  x: 1\n", ":3:4: malformed YAML"),
    "unterminated quote": ('trainer:\n  experiment_name: "abc\n', ":3:1: malformed YAML"),
    "tab indentation": ("trainer:\n\ttotal_steps: 2\n", ":2:1: malformed YAML"),
    "bad indentation": ("trainer:\n  total_steps: 2\n experiment_name: x\n", ":3:2: malformed YAML"),
    "not UTF-8": (b"trainer:\n  experiment_name: \xff\xfe\n", "not UTF-8 text"),
}


@pytest.mark.parametrize("command", ["train", "sft", "eval", "rollout", "serve"])
@pytest.mark.parametrize("case", list(BAD_YAML))
def test_a_malformed_config_yaml_is_one_line_naming_file_line_and_column(tmp_path, capsys, command, case):
    """``agentloop <command> --config bad.yaml`` for every command taking --config: exit 2 and
    one stderr line ``agentloop <command>: <file>:<line>:<col>: malformed YAML: ...``, no
    traceback. A yaml ParserError escaping means OmegaConf.load was called outside
    ``config.loading._load_yaml``."""
    from agentloop_trainer.cli.main import main

    text, expected = BAD_YAML[case]
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    argv = [command] + (["ckpt"] if command in ("eval", "rollout", "serve") else []) + ["--config", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"agentloop {command}: {bad}"), err[0]
    assert expected in err[0], err[0]


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    """A --config that does not exist: exit 2, one line naming the path (was a traceback)."""
    from agentloop_trainer.cli.main import main

    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"agentloop train: --config {tmp_path / 'nope.yaml'}: No such file or directory"]
