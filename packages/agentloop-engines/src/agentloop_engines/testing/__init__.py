"""Test helpers for engine adapters that ship with the package, so other packages' tests and
third parties can use them: a CPU stand-in for ``sglang.Engine`` and perturbed weights for
in-place update tests."""

from agentloop_engines.testing.sglang_standin import (
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    StandInSGLangEngine,
    WeightUpdate,
    write_checkpoint,
)
from agentloop_engines.testing.vllm_cpu import VLLM_CPU_ENV, use_vllm_cpu_defaults
from agentloop_engines.testing.weights import perturbed_weights

__all__ = ["DEFAULT_EOS_TOKEN_ID", "DEFAULT_VOCAB_SIZE", "VLLM_CPU_ENV", "StandInSGLangEngine", "WeightUpdate",
           "perturbed_weights", "use_vllm_cpu_defaults", "write_checkpoint"]
