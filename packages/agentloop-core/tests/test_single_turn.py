"""single_turn_agent: one generate on the rendered raw_prompt."""

from __future__ import annotations

import pytest

from agentloop_core.registry import get_agent_loop_class
from agentloop_core.single_turn import SingleTurnAgentLoop
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer
from agentloop_core.tracing import Tracer

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


class RecordingTracer(Tracer):
    def __init__(self) -> None:
        self.records: list[dict] = []

    def emit(self, record: dict) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def test_registered_by_name():
    assert get_agent_loop_class("single_turn_agent") is SingleTurnAgentLoop


async def test_one_generate(tok):
    answer = tok.encode("The answer is 5.", add_special_tokens=False) + [tok.eos_token_id]
    server = ScriptedServer([answer], eos_token_id=tok.eos_token_id)
    tracer = RecordingTracer()
    loop = SingleTurnAgentLoop(
        server, tok, config={"response_length": 16, "prompt_length": 64}, tracer=tracer
    )
    out = await loop.run({"max_tokens": 100, "temperature": 1.0}, raw_prompt=PROMPT, request_id="r-1")
    call = server.calls[0]
    assert call.request_id == "r-1"
    assert call.sampling_params.max_tokens == 16
    assert out.prompt_ids == call.prompt_ids == ChatRenderer(tok).render_prompt(PROMPT)
    assert out.response_ids == answer
    assert out.response_mask == [1] * len(answer)
    assert out.response_logprobs == call.output.log_probs
    assert out.num_turns == 3
    assert out.metrics["generate_s"] >= 0
    assert out.extra_fields["messages"][-1] == {"role": "assistant", "content": "The answer is 5."}
    assert [r["name"] for r in tracer.records] == ["generate"]
    assert tracer.records[0]["request_id"] == "r-1"
    assert tracer.records[0]["response_tokens"] == len(answer)


async def test_sampled_noise_keeps_engine_tokens(tok):
    # Prompt-seeded random ids: decoded text is junk and rarely canonical, yet the loop must
    # return exactly the engine's ids and pass the strict check.
    server = ScriptedServer(None, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    loop = SingleTurnAgentLoop(server, tok, config={"response_length": 24})
    out = await loop.run({"max_tokens": 24, "seed": 3}, raw_prompt=PROMPT)
    assert out.response_ids == server.calls[0].output.token_ids
    assert len(server.calls[0].request_id) == 32  # a fresh uuid hex when the row has none
    assert "tokenization_mismatch" not in out.metrics


async def test_prompt_too_long_is_an_error(tok):
    loop = SingleTurnAgentLoop(ScriptedServer([[1]]), tok, config={"prompt_length": 4})
    with pytest.raises(ValueError, match="prompt_length is 4"):
        await loop.run({}, raw_prompt=PROMPT)


async def test_missing_raw_prompt_is_an_error(tok):
    loop = SingleTurnAgentLoop(ScriptedServer([[1]]), tok)
    with pytest.raises(ValueError, match="raw_prompt"):
        await loop.run({}, prompt="hi")
