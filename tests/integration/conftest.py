"""Fixtures shared by the cross-package integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A randomly initialised tiny policy (with the tiny tokenizer) saved as a checkpoint."""
    pytest.importorskip("agentloop_trainer", reason="needs agentloop-trainer (nox -s integration)")
    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.policy import TinyModelConfig, build_tiny_policy

    tok = load_tiny_tokenizer()
    path = tmp_path_factory.mktemp("policy")
    build_tiny_policy(tok, seed=0, spec=TinyModelConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128)).save_pretrained(path)
    tok.save_pretrained(path)
    return path
