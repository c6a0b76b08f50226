"""A small loop that edits its own context, for the agent loop suite's segment checks (imported
by module name; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import uuid
from typing import Any

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.segments import SegmentBuilder
from agentloop_core.testing import load_tiny_tokenizer


class SummarisingLoop(AgentLoopBase):
    """Two turns; the second sees the question and a summary of the first answer instead of the
    answer itself, so its prompt does not extend the first call's and the trajectory is two
    segments (built by ``SegmentBuilder`` from the recorded calls)."""

    async def run(self, sampling_params: Any, **row: Any) -> list[AgentLoopOutput]:
        request_id = uuid.uuid4().hex
        messages = [dict(m) for m in row["raw_prompt"]]
        builder = SegmentBuilder()
        first = await self._turn(request_id, messages, sampling_params, builder)
        said = self.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        messages.append({"role": "user", "content": f"Earlier you answered {said[:60]!r}. Answer once more."})
        await self._turn(request_id, messages, sampling_params, builder)
        return self.segments(builder, num_turns=len(messages) + 1)

    async def _turn(self, request_id: str, messages: list[dict], sampling_params: Any, builder: SegmentBuilder):
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = await self.server.generate(request_id, prompt_ids, sampling_params)
        builder.add_output(prompt_ids, out)
        return out

    def segments(self, builder: SegmentBuilder, num_turns: int) -> list[AgentLoopOutput]:
        return builder.outputs(reward_score=1.0, num_turns=num_turns)


def summarising_loop(server: Any) -> SummarisingLoop:
    return SummarisingLoop(server, load_tiny_tokenizer(), {"response_length": 64})
