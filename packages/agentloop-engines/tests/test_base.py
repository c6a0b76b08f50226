"""AsyncServerBase: request validation, clamping and defaults."""

from __future__ import annotations

import pytest

from agentloop_core.protocol import AsyncServer, CapabilityNotSupportedError, SamplingParams, TokenOutput
from agentloop_core.testing import ScriptedServer
from agentloop_engines.base import AsyncServerBase


class CountingServer(AsyncServerBase):
    """Generates ``prompt[-1] + 1, +2, ...`` (mod vocab) so outputs depend on the input."""

    def __init__(self, vocab_size: int = 100, max_model_len: int = 16) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = (vocab_size - 1,)
        self.seen: list[SamplingParams] = []

    async def _generate(self, request_id, prompt_ids, sp):
        self.seen.append(sp)
        ids = [(prompt_ids[-1] + i + 1) % self.vocab_size for i in range(sp.max_tokens)]
        return TokenOutput(ids, [-1.0] * len(ids), "length")


async def test_satisfies_the_core_protocol_and_delegates():
    server = CountingServer()
    assert isinstance(server, AsyncServer)
    out = await server.generate("r", [3, 4], {"max_tokens": 3})
    assert out.token_ids == [5, 6, 7]
    assert server.seen[-1].max_tokens == 3


# What a real engine (vocabulary 100, context 16) refuses, and the message it gives.
BAD_REQUESTS = [
    ([], {}, "prompt_ids is empty"),
    ([1, 2.5], {}, r"prompt_ids\[1\] = 2.5 is not an integer"),
    ([1, "a"], {}, r"prompt_ids\[1\] = 'a' is not an integer"),
    ([1, True], {}, r"prompt_ids\[1\] = True is not an integer"),
    ([1, 2, 100], {}, r"prompt_ids\[2\] = 100 is outside the vocabulary \[0, 100\)"),
    ([5, -1], {}, r"prompt_ids\[1\] = -1 is outside the vocabulary"),
    (list(range(16)), {}, "prompt has 16 tokens but the context is 16; shorten it or raise max_model_len"),
    ([1], {"max_tokens": -2}, "max_tokens must be a positive integer"),
    ([1], {"max_token": 5}, "unknown sampling parameter 'max_token'; did you mean 'max_tokens'"),
    ([1], {"stop_token_ids": [500]}, "stop_token_ids contains 500, outside the vocabulary"),
    ([1], {"top_p": 0}, "top_p must be in"),
    ([1], {"temperature": float("nan")}, "temperature must be"),
    ([1], {"seed": 2**63}, "seed must be None or an integer in the int64 range"),
]


@pytest.mark.parametrize(("prompt", "params", "match"), BAD_REQUESTS)
async def test_bad_requests_get_clear_errors(prompt, params, match):
    server = CountingServer()
    with pytest.raises(ValueError, match=match):
        await server.generate("r", prompt, params)
    assert server.seen == [], "an invalid request must never reach _generate"


@pytest.mark.parametrize(("prompt", "params", "match"), BAD_REQUESTS)
async def test_the_scripted_test_engine_rejects_what_a_real_engine_rejects(prompt, params, match):
    """Loop tests run on ScriptedServer: it must refuse exactly these requests, with the same
    error and message, or a loop bug that only a real engine would catch passes its tests."""
    real = CountingServer(vocab_size=100, max_model_len=16)
    scripted = ScriptedServer([[1]], vocab_size=100, max_model_len=16)
    with pytest.raises(ValueError, match=match) as real_error:
        await real.generate("r", prompt, params)
    with pytest.raises(ValueError, match=match) as scripted_error:
        await scripted.generate("r", prompt, params)
    assert type(scripted_error.value) is type(real_error.value)
    assert str(scripted_error.value) == str(real_error.value)
    assert scripted.calls == []


async def test_the_scripted_test_engine_clamps_max_tokens_like_a_real_engine():
    real = CountingServer(vocab_size=100, max_model_len=16)
    scripted = ScriptedServer(None, vocab_size=100, max_model_len=16)
    for prompt, params in (([1] * 10, {"max_tokens": 100}), ([1] * 15, {"max_tokens": 100}), ([1, 2], None)):
        assert scripted.validate_request(prompt, params) == real.validate_request(prompt, params)
        out = await scripted.generate("r", prompt, {**(params or {}), "ignore_eos": True})
        assert len(out.token_ids) == real.validate_request(prompt, params).max_tokens


def test_max_tokens_is_clamped_to_the_context():
    server = CountingServer(max_model_len=16)
    assert server.validate_request([1] * 10, {"max_tokens": 100}).max_tokens == 6
    assert server.validate_request([1] * 15, {"max_tokens": 100}).max_tokens == 1
    assert server.validate_request([1] * 2, {"max_tokens": 4}).max_tokens == 4
    sp = SamplingParams(max_tokens=50, temperature=0.5)
    clamped = server.validate_request([1, 2], sp)
    assert (clamped.max_tokens, clamped.temperature) == (14, 0.5)


def test_numpy_ints_are_accepted():
    np = pytest.importorskip("numpy", reason="numpy is a dependency but check anyway")
    server = CountingServer()
    assert server.validate_request(np.array([1, 2, 3]), None).max_tokens == 13


async def test_optional_capabilities_raise_by_default():
    server = CountingServer()
    for call in (server.sleep(), server.wake_up(), server.update_weights([])):
        with pytest.raises(CapabilityNotSupportedError, match="CountingServer does not support"):
            await call
    await server.abort("anything")  # documented no-op
    await server.close()


def test_base_is_abstract():
    with pytest.raises(TypeError, match="_generate"):
        AsyncServerBase()  # type: ignore[abstract]
