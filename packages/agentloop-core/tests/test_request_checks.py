"""validate_request: the checks every engine runs, and the scripted test engine runs them too.

That a real engine (``AsyncServerBase``) gives the same error for each of these is tested in
agentloop-engines (``test_base.py``), which depends on core; core cannot import it.
"""

from __future__ import annotations

import pytest

from agentloop_core.protocol import SamplingParams
from agentloop_core.request_checks import validate_request
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer

BAD_REQUESTS = [
    ([], {}, "prompt_ids is empty; an engine needs at least one prompt token"),
    ([1, 2.5], {}, r"prompt_ids\[1\] = 2.5 is not an integer token id"),
    ([1, "hi"], {}, r"prompt_ids\[1\] = 'hi' is not an integer token id"),
    ([1, False], {}, r"prompt_ids\[1\] = False is not an integer token id"),
    ([1, 100], {}, r"prompt_ids\[1\] = 100 is outside the vocabulary \[0, 100\)"),
    ([-1], {}, r"prompt_ids\[0\] = -1 is outside the vocabulary \[0, 100\)"),
    ([1] * 16, {}, "prompt has 16 tokens but the context is 16; shorten it or raise max_model_len"),
    ([1], {"max_tokens": 0}, "max_tokens must be a positive integer"),
    ([1], {"temprature": 0.5}, "unknown sampling parameter 'temprature'; did you mean 'temperature'"),
    ([1], {"stop_token_ids": [100]}, r"stop_token_ids contains 100, outside the vocabulary \[0, 100\)"),
]


@pytest.mark.parametrize(("prompt", "params", "match"), BAD_REQUESTS)
def test_bad_requests_are_refused_with_the_first_problem_named(prompt, params, match):
    with pytest.raises(ValueError, match=match):
        validate_request(prompt, params, vocab_size=100, max_model_len=16)


@pytest.mark.parametrize(("prompt", "params", "match"), BAD_REQUESTS)
async def test_the_scripted_engine_refuses_them_too_and_records_no_call(prompt, params, match):
    server = ScriptedServer([[1, 2]], vocab_size=100, max_model_len=16)
    with pytest.raises(ValueError, match=match):
        await server.generate("r", prompt, params)
    assert server.calls == []


def test_max_tokens_is_clamped_to_what_fits_in_the_context():
    check = {"vocab_size": 100, "max_model_len": 16}
    assert validate_request([1] * 10, {"max_tokens": 100}, **check).max_tokens == 6
    assert validate_request([1] * 15, None, **check).max_tokens == 1
    kept = SamplingParams(max_tokens=4, temperature=0.5)
    assert validate_request([1, 2], kept, **check) is kept


async def test_the_scripted_engine_generates_no_more_than_fits():
    server = ScriptedServer(None, vocab_size=100, max_model_len=16)
    out = await server.generate("r", [1] * 12, {"max_tokens": 50, "ignore_eos": True})
    assert len(out.token_ids) == 4
    assert out.stop_reason == "length"
    assert server.calls[-1].sampling_params.max_tokens == 4


def test_the_scripted_engine_defaults_to_the_tiny_tokenizers_vocabulary():
    # Loop tests pair it with the tiny tokenizer; a smaller vocabulary would refuse its
    # special tokens (ChatML's <|im_start|> is id 633), as a real engine of that size would.
    assert ScriptedServer().vocab_size == len(load_tiny_tokenizer())
