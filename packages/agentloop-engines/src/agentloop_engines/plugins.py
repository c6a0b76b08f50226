"""agentloop-engines' engines as plug-ins (the ``agentloop.engines`` entry points in this
package's ``pyproject.toml``): what each can do and where its factory is.

This module imports core only, so listing the installed engines works without torch, vLLM or
SGLang; each factory, a classmethod of the adapter that maps the generic
:class:`~agentloop_core.engine_registry.EngineConfig` to its constructor, is imported when the
engine is built. The adapters' ``capabilities`` class attributes are the ``server`` records
below (declared once, here, because this module must import without the adapters' packages).
"""

from __future__ import annotations

from agentloop_core.engine_registry import DEFAULT_DTYPES, EngineCapabilities, EnginePlugin
from agentloop_core.protocol import ServerCapabilities

__all__ = ["HF_ENGINE", "SGLANG_ENGINE", "VLLM_ENGINE"]

HF_ENGINE = EnginePlugin(
    name="hf",
    factory="agentloop_engines.adapters.hf.server:HFServer.from_engine_config",
    install='pip install "agentloop-engines[hf]"',
    capabilities=EngineCapabilities(
        # sleep is True only on CUDA (an instance narrows it); on CPU sleep/wake_up still work.
        # vision: with a vision-language checkpoint (an instance serving a text model narrows it).
        # forget_session: with its prefix cache on (the default).
        server=ServerCapabilities(logprobs=True, sleep=True, weight_update=True, vision=True, forget_session=True),
        partial_rollout=True,
        seeded_sampling=True,
        policy_copy=True,
    ),
    description="transformers, batched in process (CPU or CUDA)",
)

VLLM_ENGINE = EnginePlugin(
    name="vllm",
    factory="agentloop_engines.adapters.vllm.server:VLLMServer.from_engine_config",
    install='pip install "agentloop-engines[vllm]"',
    capabilities=EngineCapabilities(
        # sleep depends on the platform (an instance sets it); False is what every platform has.
        # vision: with a vision-language checkpoint (an instance serving a text model narrows it).
        server=ServerCapabilities(logprobs=True, sleep=False, weight_update=True, prefix_cache=True, vision=True),
        partial_rollout=True,
        seeded_sampling=True,
        reserves_kv_cache=True,
        dtypes=(*DEFAULT_DTYPES, "auto"),
    ),
    description="vLLM's AsyncLLM",
)

SGLANG_ENGINE = EnginePlugin(
    name="sglang",
    factory="agentloop_engines.adapters.sglang.server:SGLangServer.from_engine_config",
    install='pip install "agentloop-engines[sglang]"',
    capabilities=EngineCapabilities(
        # sleep only with the memory saver (EngineConfig.free_cache_engine): an instance sets it.
        # vision: with a vision-language checkpoint (an instance serving a text model narrows it).
        server=ServerCapabilities(weight_update=True, prefix_cache=True, vision=True),
        # Not yet verified that abort returns the partial tokens a resumed request continues
        # from: set it once test_real_sglang_partial_rollout_resumes_across_a_weight_update
        # (gpu-marked) passes.
        partial_rollout=False,
        # SGLang honours a request's seed only with enable_deterministic_inference.
        seeded_sampling=False,
        reserves_kv_cache=True,
        dtypes=(*DEFAULT_DTYPES, "auto"),
    ),
    description="SGLang's Engine (GPU)",
)
