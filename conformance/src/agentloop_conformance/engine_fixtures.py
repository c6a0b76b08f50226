"""What every engine mixin shares: the ``engine`` fixture to override, the optional hook
fixtures, the class attributes that tune the checks, and small helpers."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from agentloop_conformance._guard import SuiteGuard
from agentloop_conformance.vision_prompts import default_vision_prompt
from agentloop_core.protocol import TokenOutput

__all__ = ["EngineFixtures", "greedy"]


def greedy(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """Greedy sampling parameters that ignore EOS, so the output length is predictable."""
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": True, **extra}


class EngineFixtures(SuiteGuard):
    """Fixtures and settings shared by the engine mixins. Override the class attributes to fit
    your engine; override the hook fixtures to turn on the checks that need them."""

    # One event loop per test class, so an engine started in a class-scoped async fixture
    # (vLLM's AsyncLLM, for one) keeps serving every test of the class.
    pytestmark = [pytest.mark.asyncio(loop_scope="class")]

    num_prompts: ClassVar[int] = 5
    """How many distinct prompts the checks use."""
    max_tokens: ClassVar[int] = 12
    """Tokens generated per request in most checks."""
    logprob_atol: ClassVar[float] = 2e-3
    """Largest accepted |engine log-prob - reference log-prob|."""
    abort_max_tokens: ClassVar[int] = 4096
    """Budget of the request the abort check cancels (clamped to the context); it must still be
    running ``abort_delay_s`` after it starts."""
    abort_delay_s: ClassVar[float] = 0.2
    """How long the abort check lets the request run before aborting it."""
    abort_timeout_s: ClassVar[float] = 5.0
    """How soon an aborted request must return."""

    @pytest.fixture
    def engine(self) -> Any:
        """The engine under test. Required: override it (usually ``scope="class"``) to start your
        engine, ``yield`` it, and stop it afterwards."""
        pytest.fail(
            f"{type(self).__name__} must define an `engine` fixture that starts the engine under test, "
            "yields it and stops it (see the agentloop-conformance README)"
        )

    @pytest.fixture
    def reference_log_probs(self, engine: Any) -> Any:
        """Optional hook ``(prompt_ids, token_ids, temperature) -> log-probs`` from a plain
        forward pass; None skips the log-prob accuracy check. See :mod:`agentloop_conformance.hooks`."""
        return None

    @pytest.fixture
    def named_weights(self, engine: Any) -> Any:
        """Optional hook ``() -> {name: tensor}`` of the current weights; None skips the
        weight-update round trip."""
        return None

    @pytest.fixture
    def vision_prompt(self, engine: Any) -> Any:
        """Optional hook ``(images, text) -> (prompt_ids, multi_modal_data)`` rendering a user
        message of ``images`` then ``text`` with the model's own processor (see
        :mod:`agentloop_conformance.vision_prompts`). The default builds it from the engine's
        ``tokenizer`` and checkpoint folder (``model_path``/``model_name``); None skips the
        vision checks of an engine that declares ``capabilities.vision``."""
        return default_vision_prompt(engine)

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def vocab_size(engine: Any) -> int:
        size = getattr(engine, "vocab_size", None)
        if not isinstance(size, int) or size < 2:
            pytest.skip(f"{type(engine).__name__} has no integer `vocab_size` attribute; the suite needs "
                        "it to build valid prompts and check ids")
        return size

    @staticmethod
    def max_model_len(engine: Any) -> int:
        size = getattr(engine, "max_model_len", None)
        if not isinstance(size, int) or size < 2:
            pytest.skip(f"{type(engine).__name__} has no integer `max_model_len` attribute (its context length)")
        return size

    def prompts(self, engine: Any) -> list[list[int]]:
        """Distinct prompts of ordinary (mid-vocabulary) ids, different lengths."""
        v = self.vocab_size(engine)
        lo, span = max(3, v // 8), max(1, v // 2)
        return [[lo + (37 * i + 11 * j) % span for j in range(3 + 2 * i)] for i in range(self.num_prompts)]

    @staticmethod
    def capability(engine: Any, name: str) -> bool:
        caps = getattr(engine, "capabilities", None)
        if caps is None:
            pytest.fail(f"{type(engine).__name__} has no `capabilities` (a ServerCapabilities); declare what it supports")
        return bool(getattr(caps, name, False))

    @staticmethod
    def check_output(out: Any, where: str) -> TokenOutput:
        assert isinstance(out, TokenOutput), f"{where}: generate returned {type(out).__name__}, expected TokenOutput"
        return out
