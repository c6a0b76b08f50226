"""ToolAgentLoop on a real engine: HFServer serving the tiny random Qwen2 model.

A random model does not call tools on purpose, so this test does not pretend it does: it runs a
real multi-turn trajectory (three or more model turns, separated by interaction replies and by
error messages for any accidental ``<tool_call>`` markup) and checks the invariant that matters
for training: the mask-1 tokens and their log-probs are exactly what the engine returned, in
order. Tool calls themselves are covered on the scripted engine in test_agent_loop.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="HFServer needs torch (pip install \"agentloop-engines[hf]\")")
hf = pytest.importorskip("agentloop_engines.adapters.hf", reason="agentloop-engines[hf] is not installed")
tiny_model = pytest.importorskip("agentloop_engines.testing.tiny_model", reason="agentloop-engines is not installed")

from agentloop_core.testing import load_tiny_tokenizer  # noqa: E402
from agentloop_tools.agent_loop import ToolAgentLoop  # noqa: E402
from agentloop_tools.builtin import calculator  # noqa: E402
from agentloop_tools.interaction import BaseInteraction  # noqa: E402


class AlwaysAskAgain(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "Please use the calculator and answer again.", 0.0, {}


class Recording:
    """Delegates to the real engine and keeps each output (no behaviour of its own)."""

    def __init__(self, server) -> None:
        self.server = server
        self.capabilities = server.capabilities
        self.outputs = []

    async def generate(self, request_id, prompt_ids, sampling_params):
        out = await self.server.generate(request_id, prompt_ids, sampling_params)
        self.outputs.append(out)
        return out


async def test_three_turn_trajectory_on_hfserver_keeps_exactly_the_engine_tokens():
    tokenizer = load_tiny_tokenizer()
    server = hf.HFServer(tiny_model.build_tiny_model(), seed=0)
    try:
        engine = Recording(server)
        # A random model rarely samples EOS; ending turns on a set of common ids (the stop token is
        # kept, like vLLM) makes short turns, so the loop reaches several turns within budget.
        stops = list(range(400, 440))
        loop = ToolAgentLoop(engine, tokenizer, {
            "tools": {"calculator": calculator}, "interaction": AlwaysAskAgain(), "max_user_turns": 2,
            "max_assistant_turns": 6, "response_length": 1024, "sanity_check": "strict",
        })
        out = await loop.run(
            {"temperature": 1.0, "top_k": 0, "stop_token_ids": stops, "logprobs": True},
            raw_prompt=[{"role": "user", "content": "What is 12 * 7?"}], request_id="hf-traj")
    finally:
        await server.close()

    assert out.metrics["assistant_turns"] == len(engine.outputs) >= 3
    assert out.metrics["user_turns"] == 2 or out.extra_fields["termination_reason"] in ("length", "max_assistant_turns")
    assert sum(len(o.token_ids) for o in engine.outputs) > len(engine.outputs)  # real turns, not single stop tokens
    generated = [t for o in engine.outputs for t in o.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    logprobs = [lp for o in engine.outputs for lp in o.log_probs]
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m] == logprobs
    assert 0 in out.response_mask  # interaction replies / glue sit between the turns with mask 0
    assert out.metrics.get("tokenization_mismatch", 0) == 0
    assert calculator.live_instances == 0
