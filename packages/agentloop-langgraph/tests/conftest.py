"""Shared helpers: the tiny tokenizer and a scripted engine that replies with encoded text.

The scripted engine is only a stand-in for the model's choices (a random tiny model never calls
tools); LangGraph, LangChain, the chat template, the tokenizer and the tools are all real.
"""

from __future__ import annotations

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture
def scripted(tokenizer):
    """``scripted(["reply text", ...])``: a ScriptedServer replying with the encoded texts + EOS."""

    def make(replies: list[str]) -> ScriptedServer:
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        encoded = [tokenizer.encode(text, add_special_tokens=False) for text in replies]
        return ScriptedServer(encoded, eos_token_id=eos, append_eos=True)

    return make
