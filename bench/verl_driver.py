"""Drive verl 0.9.1's ``ToolAgentLoop`` with the same scripted engine as our loop-overhead run.

verl's loop talks to a ``server_manager`` whose async ``generate(request_id=..., prompt_ids=...,
sampling_params=..., **multimodal)`` returns ``verl.workers.rollout.replica.TokenOutput``. The
stand-in below returns the same scripted ids (and deterministic log-probs) as
``ScriptedServer`` does for our loop, at once. As verl's own worker does, a loop object is
built per sample (with the same config/tokenizer) and its ``run`` awaited; no padding or
post-processing on either side. The tool is a verl function tool over the same calculator.

Only imported by ``bench_loop_overhead.py`` when verl is installed (the bench venv).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any


class ScriptedServerManager:
    """verl-shaped stand-in server: scripted ids, zero latency."""

    def __init__(self, reply, eos_token_id: int) -> None:
        from verl.workers.rollout.replica import TokenOutput

        self._TokenOutput = TokenOutput
        self.reply, self.eos = reply, eos_token_id
        self._calls: dict[str, int] = defaultdict(int)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **_: Any):
        index = self._calls[request_id]
        self._calls[request_id] += 1
        ids = list(self.reply(request_id, prompt_ids, index)) + [self.eos]
        return self._TokenOutput(token_ids=ids, log_probs=[-0.01 * (1 + t % 97) for t in ids],
                                 stop_reason="completed")


def _config(response_length: int):
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 1024, "response_length": response_length, "full_determinism": False,
        "multi_turn": {"max_user_turns": None, "max_assistant_turns": None, "max_parallel_calls": 4,
                       "max_tool_response_length": 1024, "tool_response_truncate_side": "middle",
                       "format": "hermes"}}}})


async def run(n: int, repeats: int, summarize) -> dict:
    from bench_loop_overhead import TOOL_CALLS, prompts, scripted_reply
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY, function_tool

    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_tools import evaluate_expression
    from agentloop_tools.builtin.calculator import format_number

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: Arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
        """
        return format_number(evaluate_expression(expression))

    if "calculator" not in FUNCTION_TOOL_REGISTRY:
        function_tool(calculator)
    tool = FUNCTION_TOOL_REGISTRY["calculator"]
    tok = load_tiny_tokenizer()
    trainer_config = DictConfigWrap(_config(2048))
    data_config = DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {}}))
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 256, "logprobs": True}
    walls = []
    for _ in range(repeats + 1):  # first run dropped, as for ours
        manager = ScriptedServerManager(scripted_reply(tok), tok.eos_token_id)

        async def one(messages: list[dict], manager=manager) -> Any:
            loop = ToolAgentLoop(trainer_config=trainer_config, server_manager=manager, tokenizer=tok,
                                 processor=None, dataset_cls=None, data_config=data_config,
                                 hf_model_type="qwen2", tools=ToolListWrap([tool]))
            return await loop.run(dict(sampling), raw_prompt=messages)

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts(n)))
        walls.append(time.perf_counter() - start)
        turns = {o.num_turns for o in outs}
        # num_turns = user + assistant turns + 1: 3 tool turns + 4 assistant turns + 1.
        if turns != {2 * TOOL_CALLS + 2}:
            raise RuntimeError(f"verl trajectories ended after num_turns={sorted(turns)}, expected "
                               f"{2 * TOOL_CALLS + 2}; the tool calls were not all made")
    return summarize(walls[1:], n)
