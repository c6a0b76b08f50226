"""The Ray actor wrapper around :class:`AgentLoopWorker` (imported inside the actor process)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.output import AgentLoopOutput
from agentloop_core.registry import import_loop_modules
from agentloop_core.runtime.worker import AgentLoopWorker
from agentloop_core.settings import RolloutConfig


class RayAgentLoopWorker:
    """Holds one :class:`AgentLoopWorker` inside a Ray actor. Its methods are async, so Ray
    runs it as an async actor and the samples of a chunk run concurrently on its event loop."""

    def __init__(
        self, server: Any, tokenizer: Any, config: RolloutConfig, tracer: Any, processor: Any
    ) -> None:
        self.worker = AgentLoopWorker(server, tokenizer, config, tracer=tracer, processor=processor)
        # Load the tokenizer now, so a bad path fails at start-up and the first batch is not slowed.
        _ = self.worker.tokenizer

    async def ready(self) -> dict[str, Any]:
        """Answer once the actor is up (the manager waits on this with a timeout): its pid and
        the id of the Ray node it runs on."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def generate_sequences(
        self,
        rows: Sequence[Mapping[str, Any]],
        validate: bool,
        step: int | None,
        sample_offset: int,
        loop_modules: Sequence[str],
    ) -> list[AgentLoopOutput]:
        """Import the modules that register the batch's loops, then run the chunk."""
        import_loop_modules(loop_modules)
        return await self.worker.generate_sequences(
            rows, validate=validate, step=step, sample_offset=sample_offset
        )
