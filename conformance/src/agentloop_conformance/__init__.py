"""agentloop-conformance: a test suite any engine, tokenizer or agent loop author runs.

Subclass a base class and define its one fixture, or run the no-code mode::

    pytest --pyargs agentloop_conformance --agentloop-tokenizer=PATH
"""

from importlib.metadata import version as _distribution_version

from agentloop_conformance._guard import guard_violations
from agentloop_conformance.engine import (
    EngineConcurrencyTests,
    EngineConformanceTests,
    EngineGenerationTests,
    EngineLogProbTests,
    EngineMemoryTests,
    EngineVisionTests,
)
from agentloop_conformance.hooks import EngineTarget, hf_named_weights, hf_reference_log_probs
from agentloop_conformance.vision_prompts import (
    VisionPrompt,
    default_vision_prompt,
    noise_image,
    vision_prompt_for,
)

__version__ = _distribution_version("agentloop-conformance")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
    "EngineConcurrencyTests",
    "EngineConformanceTests",
    "EngineGenerationTests",
    "EngineLogProbTests",
    "EngineMemoryTests",
    "EngineTarget",
    "EngineVisionTests",
    "VisionPrompt",
    "default_vision_prompt",
    "guard_violations",
    "hf_named_weights",
    "hf_reference_log_probs",
    "noise_image",
    "vision_prompt_for",
]
