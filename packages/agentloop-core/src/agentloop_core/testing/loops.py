"""Deterministic agent loops for runtime tests, registered under test-only names.

They live in the package (not in a test file) so a Ray rollout worker can import them by
module path. Importing this module registers ``test_chat``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import SamplingParams
from agentloop_core.registry import register

TEST_CHAT_AGENT = "test_chat"


class ScriptedLoopError(RuntimeError):
    """Raised on purpose by :class:`ChatTestLoop` when a row asks it to fail."""


@register(TEST_CHAT_AGENT)
class ChatTestLoop(AgentLoopBase):
    """Renders ``raw_prompt`` with the tokenizer's chat template, generates, and optionally
    appends an observation (mask 0) and generates a second turn.

    Row keys: ``raw_prompt`` (chat messages), ``observation`` (text of a fake tool result that
    triggers a second turn), ``fail`` (raise :class:`ScriptedLoopError` after the first
    generate), ``sleep_s`` (await this long before generating, to test timeouts).
    The reward is 1.0 when the first generated token id is even, else 0.0, so it depends only
    on what the engine returned.
    """

    async def run(self, sampling_params: SamplingParams | Mapping[str, Any], **row: Any) -> AgentLoopOutput:
        messages = row.get("raw_prompt")
        if not messages:
            raise ValueError("ChatTestLoop needs row['raw_prompt'], a list of chat messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        request_id = uuid.uuid4().hex
        if row.get("sleep_s"):
            await asyncio.sleep(float(row["sleep_s"]))

        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        generate_s = 0.0
        turns = 2 if row.get("observation") else 1
        for turn in range(turns):
            start = time.perf_counter()
            with self.tracer.span("generate", turn=turn):
                out = await self.server.generate(request_id, prompt_ids + response_ids, sampling_params)
            generate_s += time.perf_counter() - start
            response_ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += list(out.log_probs or [0.0] * len(out.token_ids))
            if row.get("fail"):
                raise ScriptedLoopError(f"sample asked to fail (index={row.get('index')})")
            if turn + 1 < turns:
                obs = self.tokenizer.encode(str(row["observation"]), add_special_tokens=False)
                response_ids += obs
                mask += [0] * len(obs)
                logprobs += [0.0] * len(obs)

        reward_start = time.perf_counter()
        reward = 1.0 if response_ids and response_ids[0] % 2 == 0 else 0.0
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=logprobs,
            reward_score=reward,
            num_turns=len(messages) + turns + (1 if row.get("observation") else 0),
            metrics={"generate_s": generate_s, "reward_s": time.perf_counter() - reward_start},
            extra_fields={"request_id": request_id},
        )
