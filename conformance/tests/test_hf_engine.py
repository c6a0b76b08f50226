"""The engine suite against HFServer on the tiny Qwen2 model."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("agentloop_engines", reason='needs pip install "agentloop-engines[hf]"')

from agentloop_conformance import EngineConformanceTests, hf_named_weights, hf_reference_log_probs  # noqa: E402


class TestHFServerConformance(EngineConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls):
        from agentloop_engines.hf import HFServer
        from agentloop_engines.tiny_model import build_tiny_model

        # A larger init than the default makes greedy outputs depend on the prompt.
        return HFServer(build_tiny_model(initializer_range=0.3), max_model_len=1024)

    @pytest.fixture
    def reference_log_probs(self, engine):
        return hf_reference_log_probs(engine.model)

    @pytest.fixture
    def named_weights(self, engine):
        return hf_named_weights(engine.model)
