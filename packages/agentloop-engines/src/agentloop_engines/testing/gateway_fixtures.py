"""Scripted engines and helpers for tests of the gateway and of agents run against it.

The engines answer with text encoded by the tiny ChatML tokenizer
(:func:`agentloop_core.testing.load_tiny_tokenizer`), so a test decides what the "model" says
while rendering, parsing, HTTP and the clients stay real:

- :class:`Replies`: replies keyed by the last user or tool text of the prompt, so concurrent
  tests never take each other's replies; :meth:`Replies.server` is the engine that plays them.
- :func:`scripted`: the k-th call of each session (sessions are request ids) gets the k-th reply.
- :class:`StreamingScript`: one reply streamed one token per delta, as a model writes it.
- :func:`hermes_call` / :func:`calculator_call`: a tool call as a hermes model writes it.
- :func:`generated_runs`: the runs of engine-generated tokens of a training segment.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.testing import ScriptedServer
from agentloop_core.vision import ImageItem
from agentloop_engines.base import AsyncServerBase
from agentloop_engines.streaming import TokenDelta

__all__ = ["Replies", "StreamingScript", "calculator_call", "generated_runs", "hermes_call", "scripted"]

_END_OF_TURN = "<|im_end|>"
"""The tiny ChatML tokenizer's end of turn, which every scripted reply ends with."""


def hermes_call(name: str, **arguments: Any) -> str:
    """A hermes tool call of ``name`` with ``arguments``, as the model would write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def calculator_call(expression: str) -> str:
    """A hermes call of the examples' ``calculator`` tool."""
    return hermes_call("calculator", expression=expression)


class Replies:
    """A script keyed by the last user/tool text in the prompt, so concurrent tests never take
    each other's replies: ``replies.by_prompt["What is 3 + 4?"] = [...]`` answers that prompt, one
    reply per call; a prompt with no reply left gets "I do not know."."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.by_prompt: dict[str, list[str]] = {}

    def __call__(self, request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        text = self.tokenizer.decode(prompt_ids)
        for key, replies in self.by_prompt.items():
            if text.rstrip().endswith(f"{key}{_END_OF_TURN}\n<|im_start|>assistant") and replies:
                return self.tokenizer.encode(replies.pop(0), add_special_tokens=False)
        return self.tokenizer.encode("I do not know.", add_special_tokens=False)

    def server(self) -> ScriptedServer:
        """The engine that plays this script, each reply ended with the end-of-turn token."""
        return ScriptedServer(self, eos_token_id=self.tokenizer.convert_tokens_to_ids(_END_OF_TURN), append_eos=True)


def scripted(tokenizer: Any, texts: Sequence[str], *, repeat_last: bool = False, **server: Any) -> ScriptedServer:
    """An engine whose k-th call of each session (sessions are request ids) gets ``texts[k]``
    and the end-of-turn token.

    Args:
        tokenizer: The tiny ChatML tokenizer that encodes the replies.
        texts: The replies, in call order.
        repeat_last: Calls past the script get its last reply; off, such a call fails (IndexError).
        server: More :class:`~agentloop_core.testing.ScriptedServer` arguments (``vision``, ``vocab_size``).
    """
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def reply(request_id: str, prompt_ids: list[int], k: int) -> list[int]:
        return replies[min(k, len(replies) - 1)] if repeat_last else replies[k]

    return ScriptedServer(reply, eos_token_id=tokenizer.convert_tokens_to_ids(_END_OF_TURN), append_eos=True, **server)


class StreamingScript(AsyncServerBase):
    """Streams ``reply`` (encoded once) one token per delta, then EOS: a stand-in for a model that
    writes tool calls or reasoning, so blocks interleave as a model writes them."""

    def __init__(self, tokenizer: Any, reply: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 4096
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.ids = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        return TokenOutput(token_ids=list(self.ids), log_probs=[-0.5] * len(self.ids) if sp.logprobs else None)

    async def _generate_stream(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                               images: tuple[ImageItem, ...] = ()) -> AsyncGenerator[TokenDelta, None]:
        for tok in self.ids:
            await asyncio.sleep(0)
            yield TokenDelta([tok], [-0.5] if sp.logprobs else None)
        yield TokenDelta([], [] if sp.logprobs else None, await self._generate(request_id, prompt_ids, sp))


def generated_runs(output: AgentLoopOutput) -> list[list[int]]:
    """The maximal runs of mask-1 tokens of a segment's response: one per engine call, when the
    segment holds the engine's ids exactly."""
    runs, current = [], []
    for token, mask in zip(output.response_ids, output.response_mask, strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])
