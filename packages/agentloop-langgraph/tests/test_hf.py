"""LangGraph graphs on a real engine: HFServer serving the tiny random Qwen2 model, behind the
LLMServerClient. A random model does not call tools on purpose, so these tests do not pretend it
does (tool calls are covered with a scripted engine in test_react_loop.py); they check what
matters for training: the mask-1 tokens and log-probs are exactly what the engine returned."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="HFServer needs torch (pip install \"agentloop-engines[hf]\")")
hf = pytest.importorskip("agentloop_engines.adapters.hf", reason="agentloop-engines[hf] is not installed")
tiny_model = pytest.importorskip("agentloop_engines.testing.tiny_model", reason="agentloop-engines is not installed")

from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_langgraph import ReactAgentLoop  # noqa: E402
from agentloop_tools.builtin import calculator  # noqa: E402

# A random model rarely samples EOS; ending turns on a set of common ids (kept in the output,
# like vLLM's stop_token_ids) makes short turns.
SAMPLING = {"temperature": 1.0, "top_k": 0, "stop_token_ids": list(range(400, 440)), "logprobs": True,
            "max_tokens": 48}


class Recording:
    """Delegates to the real engine and keeps each output (no behaviour of its own)."""

    def __init__(self, server) -> None:
        self.server = server
        self.capabilities = server.capabilities
        self.outputs = []
        self.request_ids = []

    async def generate(self, request_id, prompt_ids, sampling_params):
        out = await self.server.generate(request_id, prompt_ids, sampling_params)
        self.outputs.append(out)
        self.request_ids.append(request_id)
        return out


@pytest.fixture(scope="module")
def model_path():
    return tiny_model.build_tiny_model()


def check_exact_tokens(out, engine) -> None:
    generated = [t for o in engine.outputs for t in o.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    logprobs = [lp for o in engine.outputs for lp in o.log_probs]
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m] == logprobs
    assert out.metrics.get("tokenization_mismatch", 0) == 0


@pytest.mark.parametrize("graph_factory", ["langgraph_helpers:ask_again_graph", None])
async def test_graph_on_hfserver_keeps_exactly_the_engine_tokens(tokenizer, model_path, graph_factory):
    server = hf.HFServer(model_path, seed=0)
    try:
        engine = Recording(LLMServerClient([server]))
        loop = ReactAgentLoop(engine, tokenizer, {"tools": {"calculator": calculator}, "response_length": 512,
                                                  "graph_factory": graph_factory})
        out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "What is 12 * 7?"}],
                             request_id="hf-graph")
    finally:
        await server.close()

    assert not out.failed, out.metrics
    assert set(engine.request_ids) == {"hf-graph"}
    assert out.metrics["assistant_turns"] == len(engine.outputs)
    if graph_factory is not None:
        # Three real engine turns with user nudges (mask 0) between them, unless the budget ran out.
        assert len(engine.outputs) >= 3 or out.extra_fields["termination_reason"] == "response_length"
        assert 0 in out.response_mask
    else:
        assert len(engine.outputs) >= 1  # the default ReAct agent: one turn unless a call was sampled
    assert sum(len(o.token_ids) for o in engine.outputs) > len(engine.outputs)  # real turns
    check_exact_tokens(out, engine)
    assert calculator.live_instances == 0
