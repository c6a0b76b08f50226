"""``ChatRenderer.decode`` goes straight to a stock fast tokenizer's backend, and gives exactly
what ``tokenizer.decode(ids, skip_special_tokens=...)`` gives, special tokens kept or skipped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentloop_core.testing import load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_core.tokenization import ChatRenderer

SHARED_TEMPLATES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates"


@pytest.mark.parametrize("skip", [False, True], ids=["special_tokens_kept", "special_tokens_skipped"])
@pytest.mark.parametrize("template", [None, *sorted(SHARED_TEMPLATES.glob("*.jinja"))],
                         ids=lambda p: "tiny" if p is None else p.stem)
def test_decode_equals_the_tokenizers_decode(template, skip):
    tok = load_tiny_tokenizer() if template is None else tiny_tokenizer_for_template(template)
    renderer = ChatRenderer(tok)
    assert renderer._decode is not None, "a stock fast tokenizer decodes with its backend"
    rng = random.Random(0)
    special = sorted(renderer.special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(len(tok)) for _ in range(rng.randrange(30))]
        assert renderer.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), ids


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(monkeypatch):
    """``clean_up_tokenization_spaces`` changes what transformers returns; it is read at each call."""
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok)
    calls = []
    original = type(tok).decode
    monkeypatch.setattr(type(tok), "decode", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    ids = tok.encode("Hello , world .", add_special_tokens=False)
    renderer.decode(ids)
    assert calls == []
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    assert renderer.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert len(calls) == 2
