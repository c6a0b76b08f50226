"""The package's engine plug-ins. Core only: listing engines must not import torch."""

from __future__ import annotations

from agentloop_core.engine_registry import EngineCapabilities, EnginePlugin
from agentloop_core.protocol import ServerCapabilities

COUNTING_SERVER = ServerCapabilities(logprobs=True, sleep=False, weight_update=True)
"""What ``CountingServer`` declares (its ``capabilities`` class attribute is this object)."""

COUNTING_ENGINE = EnginePlugin(
    name="counting_hf",
    factory="counting_engine.server:CountingServer.from_engine_config",
    install='pip install "agentloop-counting-engine"',
    # Unlike agentloop's hf plug-in: no policy copy (it loads the checkpoint and receives every
    # update through update_weights), float32 only, no partial rollout.
    capabilities=EngineCapabilities(server=COUNTING_SERVER, seeded_sampling=True, dtypes=("float32",)),
    description="transformers, recording each request it serves",
)

COUNTING_GPU_ENGINE = EnginePlugin(
    name="counting_gpu",
    factory="counting_engine.gpu:build",
    install='pip install "agentloop-counting-engine[gpu]"',
    capabilities=EngineCapabilities(server=COUNTING_SERVER),
)
