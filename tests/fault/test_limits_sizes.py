"""Request size that the limits did not count (issue 31, class 4): every list a request can
carry is bounded, everything that gets rendered or tokenized counts toward the character limit
(numbers, booleans, nulls and nesting in tool-call arguments, stop strings, names), and the
tokenizing that is left runs on the gateway's render thread, never on the event loop.

Every server is real uvicorn on 127.0.0.1 in a thread (the engine server's own ``/v1`` and a
gateway over the same engine); clients are httpx. While a hostile request is served a thread
polls ``/health``: the event loop must keep answering it. The bounds below are generous (the
old code blocked ``/health`` for seconds); to debug a failure, run one test with ``-s`` and
look for synchronous tokenizer calls in an ``async def`` of ``agentloop_engines.serving.gateway``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.protocol import SamplingParams, TokenOutput  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread, PromptLimits  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402

HANG_S = 60.0
"""How long a client waits before calling the server stuck (a safety net, not a measurement)."""
HEALTH_BOUND_S = 2.0
"""Slowest ``/health`` answer allowed while a hostile request is served (the old code: 4-30 s)."""
REFUSE_BOUND_S = 3.0
"""Slowest refusal of an over-limit request: it is refused before the work it would cause."""
HI = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class CountingEngine(AsyncServerBase):
    """Generates four tokens; :attr:`generated` counts the calls that reached it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 1 << 20
        self.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.generated = 0

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        self.generated += 1
        ids = [(prompt_ids[-1] + i) % 200 + 1 for i in range(1, min(sp.max_tokens, 4) + 1)]
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="length")


@contextmanager
def servers(tokenizer: Any, limits: PromptLimits | None = None) -> Iterator[tuple[CountingEngine, dict[str, str]]]:
    """The engine server (its own session-less gateway) and a gateway over the same engine,
    both with ``limits``: ``(engine, {"engine": url, "gateway": url})``."""
    engine = CountingEngine(tokenizer)
    gateway = Gateway(engine, tokenizer, model_name="tiny", prompt_limits=limits)
    with ServerThread(engine, prompt_limits=limits) as srv, GatewayThread(gateway) as gw:
        yield engine, {"engine": srv.url, "gateway": gw.url}


def post_watching_health(url: str, path: str, body: Any) -> tuple[httpx.Response, float, float, int]:
    """POST ``body`` while a thread polls ``/health``: ``(response, seconds the POST took,
    slowest /health answer, /health answers during the POST)``."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=HANG_S) as http:
            while not done.is_set():
                start = time.monotonic()
                assert http.get(f"{url}/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        start = time.monotonic()
        response = httpx.post(url + path, json=body, timeout=HANG_S)
        took = time.monotonic() - start
    finally:
        done.set()
        poller.join(HANG_S)
    return response, took, max(latencies, default=0.0), len(latencies)


def assert_refused(response: httpx.Response, status: int, *needles: str) -> str:
    assert response.status_code == status, (response.status_code, response.text[:400])
    message = response.json()["error"]["message"]
    for needle in needles:
        assert needle in message, (needle, message[:400])
    assert len(message) < 2000, f"the error message repeats the hostile value ({len(message)} characters)"
    return message


def call_message(arguments: Any, calls: int = 1) -> list[dict[str, Any]]:
    """A conversation whose assistant message makes ``calls`` tool calls with ``arguments``."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*HI, {"role": "assistant", "content": "", "tool_calls": [call] * calls},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


# ---- the 300,000-entry stop list -----------------------------------------------------------------


@pytest.mark.parametrize("which", ["engine", "gateway"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_300k_entry_stop_list_is_refused_at_once(tokenizer, which, path):
    """A 3 MiB ``stop`` list (under the body limit) is refused with 413 naming
    ``max_stop_strings`` before any stop string is tokenized, and ``/health`` keeps answering.
    Debug: the old gateway tokenized each stop string on the event loop (30 s of no /health)."""
    stops = [f"s{i:06d}" for i in range(300_000)]
    prompt: dict[str, Any] = {"messages": HI} if path == CHAT else {"prompt": "hi"}
    with servers(tokenizer) as (engine, urls):
        response, took, slowest, _ = post_watching_health(urls[which], path, {**prompt, "max_tokens": 2,
                                                                               "stop": stops})
        assert_refused(response, 413, "max_stop_strings", "300000", "raise")
        assert took < REFUSE_BOUND_S, f"the refusal took {took:.1f} s"
        assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.1f} s during the request"
        assert engine.generated == 0


def test_a_big_allowed_stop_list_is_tokenized_off_the_event_loop(tokenizer):
    """With the operator's limit raised, a 150,000-entry stop list is served, and every stop
    string is tokenized on the render thread: ``/health`` answers throughout. Debug: a slow
    /health means ``single_token_stop_ids`` or ``find_stop`` ran on the event loop."""
    limits = PromptLimits(max_stop_strings=200_000, max_prompt_chars=10_000_000)
    stops = [f"s{i:06d}" for i in range(150_000)]
    with servers(tokenizer, limits) as (engine, urls):
        response, took, slowest, polls = post_watching_health(urls["gateway"], CHAT,
                                                              {"messages": HI, "max_tokens": 2, "stop": stops})
    assert response.status_code == 200, response.text[:400]
    assert engine.generated == 1
    assert polls >= 2, f"only {polls} /health answers in {took:.1f} s"
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.1f} s while the stop list was tokenized"


def test_stop_strings_count_toward_the_character_limit(tokenizer):
    """A few stop strings whose characters are over ``max_prompt_chars`` are 413 (they are
    tokenized like the prompt), on both endpoints."""
    limits = PromptLimits(max_prompt_chars=5000)
    stops = ["x" * 2000] * 3
    with servers(tokenizer, limits) as (engine, urls), httpx.Client(timeout=HANG_S) as http:
        for url in urls.values():
            for path, prompt in ((CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})):
                stop = [s + str(i) for i, s in enumerate(stops)]
                r = http.post(url + path, json={**prompt, "max_tokens": 2, "stop": stop})
                assert_refused(r, 413, "max_prompt_chars")
        assert engine.generated == 0


# ---- tool-call arguments: every JSON value counts ------------------------------------------------


HOSTILE_ARGUMENTS = {
    "numbers": {"a": list(range(3000))},
    "booleans": {"a": [True, False] * 1500},
    "nulls": {"a": [None] * 3000},
    "nested lists": {"a": [[[[1]]]] * 1000},
    "nested dicts": {"a": [{"b": {"c": 1}}] * 1000},
}


@pytest.mark.parametrize("kind", list(HOSTILE_ARGUMENTS))
def test_tool_call_arguments_count_every_json_value(tokenizer, kind):
    """Tool-call arguments full of numbers, booleans, nulls or nesting are rendered (the
    template writes them out as JSON), so their serialized size counts toward
    ``max_prompt_chars``: 413 before the template runs. Debug: the old count took strings only."""
    limits = PromptLimits(max_prompt_chars=5000)
    with servers(tokenizer, limits) as (engine, urls), httpx.Client(timeout=HANG_S) as http:
        for url in urls.values():
            r = http.post(url + CHAT, json={"messages": call_message(HOSTILE_ARGUMENTS[kind]), "max_tokens": 2})
            assert_refused(r, 413, "max_prompt_chars", "raise")
            ok = http.post(url + CHAT, json={"messages": call_message({"a": [1, 2, 3]}), "max_tokens": 2})
            assert ok.status_code == 200, ok.text[:400]
        assert engine.generated == 2


@pytest.mark.parametrize("as_string", [False, True])
def test_deeply_nested_values_are_refused_naming_the_depth_limit(tokenizer, as_string):
    """Arguments nested 100 or 5,000 deep, as the JSON string OpenAI sends (which the gateway
    decodes) or as an object, are refused before the template runs: 413 naming
    ``max_json_depth``, never a 500 from a recursion error in a JSON decoder or the template's
    ``tojson``. (A body itself nested past Python's recursion limit cannot be decoded at all:
    FastAPI answers 400 "There was an error parsing the body".)"""
    import json

    with servers(tokenizer) as (engine, urls), httpx.Client(timeout=HANG_S) as http:
        for url in urls.values():
            for depth in (100, 5000):
                nested = '{"a": ' + "[" * depth + "1" + "]" * depth + "}"
                arguments = json.dumps(nested) if as_string else nested
                # Written by hand: the client's own json.dumps cannot nest 5,000 deep.
                body = ('{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                        '"content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", '
                        f'"arguments": {arguments}}}}}]}}]}}')
                r = http.post(url + CHAT, content=body, headers={"content-type": "application/json"})
                if as_string or depth == 100:
                    assert_refused(r, 413, "max_json_depth", "raise")
                else:
                    assert_refused(r, 400, "parsing the body")
        assert engine.generated == 0


# ---- every other list ------------------------------------------------------------------------------


def test_every_list_of_a_request_is_bounded(tokenizer):
    """``tools``, a message's ``tool_calls``, ``stop`` and ``stop_token_ids`` each have a
    bound; over it the request is refused at once naming the field, the limit and how to raise
    it, and the engine never sees it. Debug: find the list's check in ``PromptLimits`` (or
    ``SamplingParams`` for ``stop_token_ids``)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases: list[tuple[str, int, tuple[str, ...], dict[str, Any]]] = [
        (CHAT, 413, ("max_tools", "raise"), {"messages": HI, "tools": [tool] * 1000}),
        (CHAT, 413, ("max_tool_calls", "raise"), {"messages": call_message({"a": 1}, calls=1000)}),
        (CHAT, 413, ("max_stop_strings", "raise"), {"messages": HI, "stop": [f"s{i}" for i in range(100)]}),
        (COMPLETIONS, 413, ("max_stop_strings",), {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]}),
        (CHAT, 400, ("stop_token_ids", "1024"), {"messages": HI, "stop_token_ids": [5] * 1_000_000}),
        (COMPLETIONS, 400, ("stop_token_ids", "1024"), {"prompt": "hi", "stop_token_ids": [5] * 1_000_000}),
        (COMPLETIONS, 413, ("max_prompt_tokens",), {"prompt": [5] * 1_000_000}),
        (CHAT, 400, ("logit_bias",), {"messages": HI, "logit_bias": {str(i): 1 for i in range(300_000)}}),
        (CHAT, 400, ("unsupported",), {"messages": HI, **{f"k{i}": 1 for i in range(100_000)}}),
    ]
    with servers(tokenizer) as (engine, urls):
        for url in urls.values():
            for path, status, needles, body in cases:
                response, took, slowest, _ = post_watching_health(url, path, {"max_tokens": 2, **body})
                assert_refused(response, status, *needles)
                assert took < REFUSE_BOUND_S, (needles, f"the refusal took {took:.1f} s")
                assert slowest < HEALTH_BOUND_S, (needles, f"/health took {slowest:.1f} s")
        assert engine.generated == 0


def test_a_huge_stop_token_ids_list_on_generate_is_refused_at_once(tokenizer):
    """The token-level ``/generate`` refuses a 1,000,000-entry ``stop_token_ids`` with 400
    naming the key and its bound, before the engine sees it; ``/health`` keeps answering."""
    with servers(tokenizer) as (engine, urls):
        body = {"request_id": "r", "prompt_ids": [1, 2], "sampling_params": {"stop_token_ids": [5] * 1_000_000}}
        response, took, slowest, _ = post_watching_health(urls["engine"], "/generate", body)
        assert_refused(response, 400, "stop_token_ids", "1024")
        assert took < REFUSE_BOUND_S, f"the refusal took {took:.1f} s"
        assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.1f} s"
        assert engine.generated == 0
