"""The gateway in front of a real engine: the tiny Qwen2 model in HFServer on the CPU, driven
by the real ``openai`` client. If the ids differ from a direct ``generate`` with the same greedy
parameters, the gateway changed the prompt or the sampling parameters on the way."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402

GREEDY = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine():
    # A larger init than the training default makes greedy outputs depend on the prompt.
    return HFServer(build_tiny_model(initializer_range=0.3), max_model_len=256)


def test_chat_and_completion_on_the_tiny_model(engine):
    gateway = Gateway(engine, engine.tokenizer)
    with GatewayThread(gateway) as t:
        c = openai.OpenAI(base_url=t.session_url("hf-1"), api_key="none", max_retries=0, timeout=60)
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "How many apples?"}],
                                         **GREEDY)
        text = c.completions.create(model="tiny", prompt="Ann has 3 apples.", **GREEDY)
    calls = gateway.close_session("hf-1")
    assert [call.endpoint for call in calls] == ["chat.completions", "completions"]

    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "How many apples?"}],
                                                  add_generation_prompt=True, tokenize=False)
    assert chat.prompt_token_ids == engine.tokenizer.encode(prompt, add_special_tokens=False) == calls[0].prompt_ids
    assert text.prompt_token_ids == engine.tokenizer.encode("Ann has 3 apples.") == calls[1].prompt_ids
    for response_ids, call in ((chat.choices[0].token_ids, calls[0]), (text.choices[0].token_ids, calls[1])):
        direct = asyncio.run(engine.generate("direct", call.prompt_ids, {**GREEDY, "logprobs": True}))
        assert response_ids == call.token_ids == direct.token_ids
        assert call.log_probs == pytest.approx(direct.log_probs, abs=1e-5)
    assert chat.choices[0].message.content == engine.tokenizer.decode(calls[0].token_ids, skip_special_tokens=True)
    assert text.choices[0].text == engine.tokenizer.decode(calls[1].token_ids, skip_special_tokens=True)
