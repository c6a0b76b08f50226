"""Eight stock ``openai``-client cases against every way agentloop serves ``/v1``.

The same cases run against the gateway's own app (``GatewayThread``), the engine server with a
gateway mounted (``ServerThread(engine, gateway=...)``, what ``agentloop serve`` runs) and the
engine server alone (``ServerThread(engine, tool_parser=...)``, no gateway built by the caller):
one OpenAI-compatible implementation, so each case passes or fails on all three alike. A case
that fails on one mounting only means that mounting serves ``/v1`` through other code than
:class:`~agentloop_engines.serving.gateway.Gateway`: look at how it adds its routes.

The engine replies with scripted text, so each case decides what the "model" says; rendering
(the tiny tokenizer's ChatML template), tool-call parsing (hermes), HTTP, SSE and the client are
all real.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason='these tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.protocol import SamplingParams, TokenOutput  # noqa: E402
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402

KEY = "cases-key"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
HI = [{"role": "user", "content": "hi"}]
MOUNTINGS = ("gateway", "engine+gateway", "engine")


class ScriptedEngine(AsyncServerBase):
    """An engine adapter whose "model" says ``replies[last user or tool text]`` (else "I do not
    know."), then EOS; ``scripted.calls`` records what it was asked and what it returned."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 4096
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_token_ids = (eos,)
        self.model_name = "tiny"
        self.replies: dict[str, str] = {}
        self.scripted = ScriptedServer(self._reply, eos_token_id=eos, append_eos=True)

    def _reply(self, request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        text = self.tokenizer.decode(prompt_ids)
        for key, reply in self.replies.items():
            if text.rstrip().endswith(f"{key}<|im_end|>\n<|im_start|>assistant"):
                return self.tokenizer.encode(reply, add_special_tokens=False)
        return self.tokenizer.encode("I do not know.", add_special_tokens=False)

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        return await self.scripted.generate(request_id, prompt_ids, sp)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tiny_tokenizer()


@pytest.fixture(scope="module", params=MOUNTINGS)
def served(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[tuple[ScriptedEngine, openai.OpenAI]]:
    engine = ScriptedEngine(tokenizer)
    if request.param == "engine":
        thread: Any = ServerThread(engine, api_key=KEY, tool_parser="hermes")
    else:
        gateway = Gateway(engine, tokenizer, tool_parser="hermes")
        thread = (GatewayThread(gateway, api_key=KEY) if request.param == "gateway"
                  else ServerThread(engine, api_key=KEY, gateway=gateway))
    with thread:
        yield engine, openai.OpenAI(base_url=f"{thread.url}/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture
def engine(served: tuple[ScriptedEngine, Any]) -> ScriptedEngine:
    served[0].replies.clear()
    served[0].scripted.calls.clear()
    return served[0]


@pytest.fixture
def client(served: tuple[Any, openai.OpenAI]) -> openai.OpenAI:
    return served[1]


def test_1_chat_returns_the_text_and_the_exact_tokens(engine, client):
    engine.replies["hi"] = "Hello there."
    r = client.chat.completions.create(model="m", messages=HI)
    (call,) = engine.scripted.calls
    assert r.choices[0].message.content == "Hello there."
    assert r.choices[0].finish_reason == "stop"
    assert r.prompt_token_ids == call.prompt_ids
    assert r.choices[0].token_ids == call.output.token_ids
    assert r.usage.completion_tokens == len(call.output.token_ids)


def test_2_chat_streams_server_sent_events(engine, client):
    engine.replies["hi"] = "Hello there."
    chunks = list(client.chat.completions.create(model="m", messages=HI, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello there."
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_3_a_text_stop_cuts_the_reply(engine, client):
    engine.replies["count"] = "one two STOP three"
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "count"}], stop=["STOP"])
    assert r.choices[0].message.content == "one two "
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].token_ids == engine.scripted.calls[0].output.token_ids[: len(r.choices[0].token_ids)]


def test_4_tool_calls_come_back_parsed(engine, client):
    engine.replies["What is 3 + 4?"] = ("<tool_call>\n" + json.dumps({"name": "calculator", "arguments":
                                                                       {"expression": "3 + 4"}}) + "\n</tool_call>")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 3 + 4?"}],
                                       tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "3 + 4"}


def test_5_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_6_text_completions(engine, client, tokenizer):
    r = client.completions.create(model="m", prompt="The answer is", max_tokens=4)
    (call,) = engine.scripted.calls
    assert call.prompt_ids == tokenizer.encode("The answer is")
    assert r.choices[0].text == tokenizer.decode(call.output.token_ids, skip_special_tokens=True)


def test_7_chat_log_probs_are_openai_shaped(engine, client):
    engine.replies["hi"] = "ok"
    r = client.chat.completions.create(model="m", messages=HI, logprobs=True)
    assert r.choices[0].logprobs is not None, "no logprobs in the choice"
    assert [t.logprob for t in r.choices[0].logprobs.content] == engine.scripted.calls[0].output.log_probs


def test_8_an_unsupported_parameter_is_a_400_naming_it(engine, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=HI, n=2)
    assert "n=2" in info.value.body["message"] or "n=1" in info.value.body["message"], info.value.body
    assert engine.scripted.calls == []
