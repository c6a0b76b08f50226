"""The engine suite against HFServer on the tiny Qwen2 model, and its vision checks on the tiny
Qwen2-VL."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("agentloop_engines", reason='needs pip install "agentloop-engines[hf]"')

from agentloop_conformance import (  # noqa: E402
    EngineConformanceTests,
    EngineVisionTests,
    hf_named_weights,
    hf_reference_log_probs,
)


class TestHFServerConformance(EngineConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls):
        from agentloop_engines.adapters.hf import HFServer
        from agentloop_engines.testing.tiny_model import build_tiny_model

        # A larger init than the default makes greedy outputs depend on the prompt.
        return HFServer(build_tiny_model(initializer_range=0.3), max_model_len=1024)

    @pytest.fixture
    def reference_log_probs(self, engine):
        return hf_reference_log_probs(engine.model)

    @pytest.fixture
    def named_weights(self, engine):
        return hf_named_weights(engine.model)


class TestHFServerVisionConformance(EngineVisionTests):
    """The vision checks on HFServer serving the tiny Qwen2-VL (its prompts from the suite's
    default ``vision_prompt``: the checkpoint's own processor and chat template)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls):
        from agentloop_engines.adapters.hf import HFServer
        from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

        return HFServer(build_tiny_vlm(initializer_range=0.3), max_model_len=1024)

    @pytest.fixture(scope="class")
    @classmethod
    def placeholder_engine(cls, tmp_path_factory):
        from agentloop_conformance.placeholder_model import placeholder_preferring_checkpoint
        from agentloop_engines.adapters.hf import HFServer
        from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

        folder = placeholder_preferring_checkpoint(build_tiny_vlm(initializer_range=0.3),
                                                   tmp_path_factory.mktemp("placeholder-vlm"))
        return HFServer(str(folder), max_model_len=1024)
