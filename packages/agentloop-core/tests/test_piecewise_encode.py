"""Piecewise encoding (text between special tokens, each piece remembered) gives exactly the
tokenizer's own ids, is refused where a tokenizer may not encode pieces on their own, and
turns itself off when a text says otherwise."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import pytest

from agentloop_core.testing import load_tiny_tokenizer, tiny_tokenizer_for_template, tiny_tokenizer_path
from agentloop_core.tokenization import ChatRenderer, chat_template_names, piecewise, resolve_chat_template
from agentloop_core.tokenization.builtin_templates import BUILTINS
from agentloop_core.tokenization.piecewise import PiecewiseEncoder, piecewise_encoder

SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")

WORDS = ["What", " is", " 6*7", "?", "\n", "  ", "\t", "é", "日本", "🙂", "<tool_call>", "</tool_call>", '{"x": 1}',
         " 42", "\n\n", "ap", "ples", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "assistant", "user\n", " "]


def _texts(tok, n: int, seed: int = 0) -> list[str]:
    """Rendered conversations plus random strings of words and special tokens (special tokens
    back to back, at either end, whitespace on either side of them)."""
    rng = random.Random(seed)
    convo = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": " What is 6*7? "},
             {"role": "assistant", "content": "It is 42.\n"}, {"role": "user", "content": "日本 🙂\n\n"}]
    texts = [tok.apply_chat_template(convo[:k], tokenize=False, add_generation_prompt=True) for k in range(1, 5)]
    texts += ["".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    return texts


def _params() -> list:
    params = [pytest.param(None, id="tiny")]
    params += [pytest.param(f"template:{p}", id=p.stem) for p in sorted(SHARED_TEMPLATES.glob("*.jinja"))]
    params += [pytest.param(f"builtin:{name}", id=f"builtin-{name}") for name in chat_template_names()]
    params += [pytest.param(folder, id=Path(folder).name)
               for folder in filter(None, os.environ.get("AGENTLOOP_TOKENIZER_DIRS", "").split(":"))]
    return params


def _load(param: str | None):
    if param is None:
        return load_tiny_tokenizer()
    if param.startswith("template:"):
        return tiny_tokenizer_for_template(param.removeprefix("template:"))
    if param.startswith("builtin:"):
        name = param.removeprefix("builtin:")
        return tiny_tokenizer_for_template(BUILTINS[name].file, chat_template=resolve_chat_template(name))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(param)


@pytest.mark.parametrize("param", _params())
def test_piecewise_ids_are_the_tokenizers_own(param):
    tok = _load(param)
    renderer = ChatRenderer(tok)
    whole = [list(tok.encode(t, add_special_tokens=False)) for t in _texts(tok, 300)]
    for _ in range(2):  # the second pass finds every piece remembered
        assert [renderer.encode(t) for t in _texts(tok, 300)] == whole
    if renderer._piecewise is not None:
        assert renderer._piecewise.enabled, "a text differed: piecewise encoding switched itself off"


def test_the_tiny_tokenizer_encodes_piecewise_and_remembers_the_pieces():
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok)
    encoder = renderer._piecewise
    assert isinstance(encoder, PiecewiseEncoder)
    assert encoder.enabled
    assert ChatRenderer(tok)._piecewise is encoder, "renderers of one tokenizer share one memory of pieces"
    system = "You are a calculator agent. " * 20
    renderer.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")
    assert f"system\n{system}" in encoder._pieces


def _metaspace_tokenizer():
    """A SentencePiece-like tokenizer: Metaspace adds "▁" before the first piece of text only,
    so the text after a special token encodes differently alone than in place."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    lines = ["hello world what is six times seven", "the answer is forty two", "user assistant system"] * 50
    tok.train_from_iterator(lines, trainer=trainers.BpeTrainer(vocab_size=200, show_progress=False))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=None, unk_token=None, bos_token=None)
    wrapped.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                              for t in ("<|im_start|>", "<|im_end|>")]})
    wrapped.chat_template = load_tiny_tokenizer().chat_template
    return wrapped


def test_a_prefix_space_tokenizer_is_refused_and_would_differ(caplog):
    tok = _metaspace_tokenizer()
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert piecewise_encoder(tok, ("<|im_start|>", "<|im_end|>")) is None
    # Forced on anyway, the first text already differs: the check switches it off and the
    # caller still gets the tokenizer's own ids.
    backend = tok.backend_tokenizer
    forced = PiecewiseEncoder(tok, ("<|im_start|>", "<|im_end|>"),
                              lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)])
    with caplog.at_level(logging.WARNING, logger=piecewise.__name__):
        got = forced.encode(text)
    assert got == tok.encode(text, add_special_tokens=False)
    assert not forced.enabled
    assert "encoded whole from now on" in caplog.text
    assert forced.encode("hello<|im_end|>world") == tok.encode("hello<|im_end|>world", add_special_tokens=False)


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "normalized"])
def test_special_tokens_that_are_no_clean_cut_are_refused(flag):
    from transformers import AddedToken, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))  # its own copy, changed below
    tok.add_tokens([AddedToken("<|cut|>", special=True, **{flag: True})], special_tokens=True)
    assert piecewise_encoder(tok, ("<|im_start|>", "<|im_end|>", "<|cut|>")) is None
    for text in ("a <|cut|> b", "x<|cut|>y", "<|im_start|>user\n <|cut|>\n<|im_end|>"):
        assert ChatRenderer(tok).encode(text) == tok.encode(text, add_special_tokens=False)


def test_the_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(piecewise, "MAX_PIECES", 8)
    monkeypatch.setattr(piecewise, "MAX_PIECE_CHARS", 50)
    tok = load_tiny_tokenizer()
    encoder = PiecewiseEncoder(tok, ("<|im_start|>", "<|im_end|>"), lambda texts: [
        tok.encode(t, add_special_tokens=False) for t in texts])
    for i in range(40):
        text = f"<|im_start|>tool\nresult {i}<|im_end|>\n" + "long " * (i % 3) * 20
        assert encoder.encode(text) == tok.encode(text, add_special_tokens=False)
        assert len(encoder._pieces) <= 8
    assert all(len(piece) <= 50 for piece in encoder._pieces)


def test_a_full_memory_keeps_the_pieces_a_text_was_found_to_have(monkeypatch):
    """The memory fills up on a text that has both a remembered piece (the system prompt every
    prompt repeats) and new ones: starting afresh must not lose the remembered piece that text
    is built from. It did (a KeyError from ``encode`` some 8192 new pieces into the main job's
    SFT warm-up). Debug: ``PiecewiseEncoder.encode`` must replace its memory when full, not
    empty the dict it is reading."""
    monkeypatch.setattr(piecewise, "MAX_PIECES", 4)
    tok = load_tiny_tokenizer()
    calls: list[list[str]] = []

    def encode_many(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return [tok.encode(t, add_special_tokens=False) for t in texts]

    encoder = PiecewiseEncoder(tok, ("<|im_start|>", "<|im_end|>"), encode_many)
    system = "<|im_start|>system\nSolve it, then answer as #### N.<|im_end|>\n"
    for i in range(30):
        text = f"{system}<|im_start|>user\nquestion {i}<|im_end|>\n<|im_start|>assistant\n"
        assert encoder.encode(text) == tok.encode(text, add_special_tokens=False), i
        assert len(encoder._pieces) <= 4
    assert sum(len(c) for c in calls) < 30 * 4, "no piece was ever remembered"
