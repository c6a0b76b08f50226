"""The rollout runtime: workers that run agent loops concurrently and the manager that
splits batches over them (in this process or as Ray actors)."""

from agentloop_core.registry import import_loop_modules
from agentloop_core.runtime.manager import AgentLoopManager, split_evenly
from agentloop_core.runtime.pacing import PacedServer, TurnPacer, turn_slot
from agentloop_core.runtime.seeding import SeededServer, derive_seed, sample_seed_scope
from agentloop_core.runtime.worker import AgentLoopWorker, SampleTimeoutError

__all__ = [
    "AgentLoopManager", "AgentLoopWorker", "SampleTimeoutError", "SeededServer", "derive_seed",
    "PacedServer", "TurnPacer", "import_loop_modules", "sample_seed_scope", "split_evenly", "turn_slot",
]
