"""Shared fixtures: the tiny tokenizer and a small random policy (fast on 2 cores)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer tests need torch")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # 2 cores shared by several processes: more threads only adds contention.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from agentloop_core.testing import load_tiny_tokenizer

    return load_tiny_tokenizer()


@pytest.fixture(scope="session")
def random_model_path(tmp_path_factory, tokenizer):
    """A randomly initialised tiny policy saved as a Hugging Face checkpoint."""
    from agentloop_trainer.model import TinyModelSpec, build_tiny_policy

    path = tmp_path_factory.mktemp("random_policy")
    model = build_tiny_policy(tokenizer, seed=0, spec=TinyModelSpec(hidden_size=64, intermediate_size=128))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
