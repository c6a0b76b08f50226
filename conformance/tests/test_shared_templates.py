"""The tokenization suite against the real chat templates in ../shared/data/chat_templates
(Qwen3, gpt-oss, Mistral Nemo), each with the tiny tokenizer plus the special tokens it writes.
A fresh clone has no ../shared: the class then skips, saying so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentloop_conformance.tokenization import TokenizationConformanceTests
from agentloop_core.testing import tiny_tokenizer_for_template

# AGENTLOOP_CHAT_TEMPLATES points at the folder from a checkout that is not beside ../shared.
SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3] / "shared" / "data" / "chat_templates")
TEMPLATES = sorted(SHARED_TEMPLATES.glob("*.jinja"))


@pytest.mark.skipif(not TEMPLATES, reason=f"no chat templates in {SHARED_TEMPLATES} (absent in a fresh clone)")
class TestSharedTemplateConformance(TokenizationConformanceTests):
    @pytest.fixture(scope="class", params=TEMPLATES, ids=[path.stem for path in TEMPLATES])
    @classmethod
    def tokenizer(cls, request):
        return tiny_tokenizer_for_template(request.param)
