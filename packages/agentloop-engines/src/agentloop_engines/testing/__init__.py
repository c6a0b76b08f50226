"""Test helpers for engine adapters that ship with the package, so other packages' tests and
third parties can use them: a CPU stand-in for ``sglang.Engine``, perturbed weights for
in-place update tests, scripted engines for tests of the gateway and of agents run against it
(:mod:`~agentloop_engines.testing.gateway_fixtures`), and the tiny random checkpoints every engine
can serve, for tests and demos (:mod:`~agentloop_engines.testing.tiny_model`,
:mod:`~agentloop_engines.testing.tiny_vlm`; ``build_tiny_model`` is also
``agentloop_engines.build_tiny_model``)."""

from agentloop_engines.testing.gateway_fixtures import (
    Replies,
    StreamingScript,
    calculator_call,
    generated_runs,
    hermes_call,
    scripted,
)
from agentloop_engines.testing.sglang_standin import (
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    StandInSGLangEngine,
    WeightUpdate,
    write_checkpoint,
)
from agentloop_engines.testing.vllm_cpu import VLLM_CPU_ENV, use_vllm_cpu_defaults
from agentloop_engines.testing.weights import perturbed_weights

__all__ = ["DEFAULT_EOS_TOKEN_ID", "DEFAULT_VOCAB_SIZE", "VLLM_CPU_ENV", "Replies", "StandInSGLangEngine",
           "StreamingScript", "WeightUpdate", "calculator_call", "generated_runs", "hermes_call", "perturbed_weights",
           "scripted", "use_vllm_cpu_defaults", "write_checkpoint"]
