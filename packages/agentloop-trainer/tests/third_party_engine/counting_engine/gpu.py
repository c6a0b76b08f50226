"""An engine whose package is missing here: importing this module fails."""

import agentloop_counting_engine_gpu_kernels  # noqa: F401  # not installed anywhere

build = None
