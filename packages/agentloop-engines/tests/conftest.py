"""Fixtures shared by the engines tests: the tiny model most of them run and, for weight-update
tests, its weights before and after a perturbation.

torch and transformers are imported inside the fixtures: a test module that needs them skips
(``pytest.importorskip``) before it asks for one, so the package's tests still collect without
the hf extra. A module that needs another model defines its own ``model_path``, which overrides
this one for that module (and so for the weight fixtures it requests).

The gateway tests' scripted engine: ``tokenizer`` (the tiny ChatML one), ``replies`` (a
:class:`~agentloop_engines.testing.gateway_fixtures.Replies` script keyed by prompt) and
``engine`` (the ``ScriptedServer`` that plays it); a module with another engine or tokenizer
defines its own.
"""

from __future__ import annotations

from typing import Any

import pytest

INIT = 0.3
"""A larger init than the training default: random greedy outputs then depend on the prompt,
so "same tokens" comparisons mean something."""


@pytest.fixture(scope="module")
def model_path():
    """The tiny Qwen2 at ``initializer_range=INIT`` (built once, then cached on disk)."""
    from agentloop_engines.testing.tiny_model import build_tiny_model

    return build_tiny_model(initializer_range=INIT)


@pytest.fixture(scope="module")
def _weights(model_path) -> tuple[dict[str, Any], dict[str, Any]]:
    from agentloop_engines.testing import perturbed_weights

    return perturbed_weights(model_path)  # tied tensors get one value


@pytest.fixture(scope="module")
def old_weights(_weights) -> dict[str, Any]:
    """``model_path``'s own weights (float32 state dict)."""
    return _weights[0]


@pytest.fixture(scope="module")
def new_weights(_weights) -> dict[str, Any]:
    """``old_weights`` plus 0.05 x N(0, 1) noise (see ``agentloop_engines.testing.perturbed_weights``)."""
    return _weights[1]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny ChatML tokenizer."""
    from agentloop_core.testing import load_tiny_tokenizer

    return load_tiny_tokenizer()


@pytest.fixture
def replies(tokenizer) -> Any:
    """What the scripted ``engine`` answers, by prompt: ``replies.by_prompt["hi"] = ["Hello."]``."""
    from agentloop_engines.testing.gateway_fixtures import Replies

    return Replies(tokenizer)


@pytest.fixture
def engine(replies) -> Any:
    """A ``ScriptedServer`` playing ``replies``."""
    return replies.server()
