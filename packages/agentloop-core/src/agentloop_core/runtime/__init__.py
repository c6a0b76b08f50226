"""The rollout runtime: workers that run agent loops concurrently and the manager that
splits batches over them (in this process or as Ray actors)."""

from agentloop_core.runtime.manager import AgentLoopManager, split_evenly
from agentloop_core.runtime.worker import AgentLoopWorker, SampleTimeoutError, import_loop_modules

__all__ = ["AgentLoopManager", "AgentLoopWorker", "SampleTimeoutError", "import_loop_modules", "split_evenly"]
