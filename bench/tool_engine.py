"""An honest tool-calling engine for benchmarks: real HFServer decoding, scripted reply ids.

A random tiny model never writes a tool call, so a benchmark of tool-call overlap needs an
engine that does. :class:`ToolCallingHFServer` wraps a real :class:`HFServer`: every
``generate`` call first runs HFServer's batched decoding on the given prompt for exactly as
many tokens as the scripted reply has (``ignore_eos``, so the engine cost is that of a real
reply of that length, batched with the other requests in flight), then discards the sampled
ids and returns the tokenizer-encoded scripted reply (a calculator call on turns 0..n-1, a
final answer after). Log-probs are not returned (they would belong to the discarded ids).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput

FILLER = "First add the numbers, then multiply the sum by three. "


def calculator_turns(num_tool_calls: int, filler: str = FILLER) -> Callable[[str, int], str]:
    """Reply text for call ``index`` of a trajectory: ``num_tool_calls`` calculator calls,
    then a final answer."""

    def reply(request_id: str, index: int) -> str:
        if index < num_tool_calls:
            call = {"name": "calculator", "arguments": {"expression": f"({index + 2} + 5) * 3"}}
            return f"{filler}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return f"{filler}The answer is 21.\n#### 21"

    return reply


class ToolCallingHFServer:
    """Real HFServer decoding cost, scripted reply ids (see the module docstring).

    Args:
        hf: The HFServer doing the decoding.
        tokenizer: Encodes the scripted replies.
        reply: ``(request_id, call_index) -> text`` of each reply.

    Attributes:
        calls: ``(request_id, call_index, prompt_ids, n_tokens)`` of every call, for replay.
    """

    capabilities = ServerCapabilities(logprobs=False)

    def __init__(self, hf: Any, tokenizer: Any, reply: Callable[[str, int], str]) -> None:
        self.hf, self.tokenizer, self.reply = hf, tokenizer, reply
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._index: dict[str, int] = defaultdict(int)
        self.calls: list[tuple[str, int, list[int], int]] = []
        self.decoded_tokens = 0

    def reset(self) -> None:
        self._index.clear()
        self.calls.clear()
        self.decoded_tokens = 0

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams) -> TokenOutput:
        sp = SamplingParams.from_mapping(sampling_params)
        index = self._index[request_id]
        self._index[request_id] += 1
        ids = self.tokenizer.encode(self.reply(request_id, index), add_special_tokens=False) + [self.eos]
        ids = ids[: sp.max_tokens]
        out = await self.hf.generate(request_id, list(prompt_ids), {
            "max_tokens": len(ids), "ignore_eos": True, "temperature": 1.0, "logprobs": False,
            "seed": index})
        if len(out.token_ids) != len(ids):
            raise RuntimeError(f"HFServer decoded {len(out.token_ids)} tokens, expected {len(ids)}")
        self.calls.append((request_id, index, list(prompt_ids), len(ids)))
        self.decoded_tokens += len(ids)
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="stop" if ids[-1] == self.eos else "length")

    async def abort(self, request_id: str) -> None:
        await self.hf.abort(request_id)

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def update_weights(self, named_tensors) -> None:
        raise NotImplementedError("benchmark engine")
