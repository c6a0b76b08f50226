"""The tokenization suite against the tiny ChatML tokenizer."""

from __future__ import annotations

import pytest

from agentloop_conformance.tokenization import TokenizationConformanceTests
from agentloop_core.testing import load_tiny_tokenizer


class TestTinyTokenizerConformance(TokenizationConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls):
        return load_tiny_tokenizer()
