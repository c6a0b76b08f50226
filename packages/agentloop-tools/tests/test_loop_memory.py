"""What a tool-agent trajectory holds between turns (issue 49 item 5: memory per trajectory at
4096 concurrent): the engine's output of a turn is not kept once the trajectory has its ids."""

from __future__ import annotations

import json
import weakref

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.builtin import calculator


class _WatchingEngine:
    """Says a calculator call, then an answer; at each call records whether the outputs it
    returned earlier are still alive somewhere."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.returned: list[weakref.ref[TokenOutput]] = []
        self.alive_at_call: list[int] = []

    async def generate(self, request_id, prompt_ids, sampling_params=None, **multi_modal):
        self.alive_at_call.append(sum(ref() is not None for ref in self.returned))
        call = {"name": "calculator", "arguments": {"expression": "(2 + 5) * 3"}}
        text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>" if not self.returned else "The answer is 21."
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        out = TokenOutput(token_ids=ids, log_probs=[-0.1] * len(ids), stop_reason="stop")
        self.returned.append(weakref.ref(out))
        return out


async def test_the_loop_lets_go_of_a_turns_engine_output_before_the_next_generate():
    tok = load_tiny_tokenizer()
    engine = _WatchingEngine(tok)
    loop = ToolAgentLoop(engine, tok, {"tools": {"calculator": calculator}, "response_length": 2048})
    out = await loop.run({"max_tokens": 64, "logprobs": True},
                         raw_prompt=[{"role": "user", "content": "What is (2 + 5) * 3?"}])
    assert out.metrics["tool_calls"] == 1
    assert engine.alive_at_call == [0, 0], "the first turn's TokenOutput was still alive during the second generate"
    assert out.response_logprobs is not None
    assert out.response_logprobs.count(-0.1) == out.response_mask.count(1)
