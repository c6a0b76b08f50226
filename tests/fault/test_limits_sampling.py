"""Type confusion in sampling values (issue 31, class 8): ``ignore_eos="false"`` and
``logprobs="yes"`` were taken as truthy strings, ``stop_token_ids="123"`` became ``(1, 2, 3)``.
A value of the wrong type is an error naming the key and the type expected, at every entry
point: :class:`SamplingParams` itself (the one validator), the engine server's ``/generate``,
the gateway's ``/v1`` routes and session opening (on both servers), the rollout config and
the trainer config. To debug a failure, check that the entry point goes through
``SamplingParams.from_mapping`` (``agentloop_core.protocol``) rather than a copy of its checks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentloop_core.protocol import SamplingParams, TokenOutput

# (key, value, what the message must say)
CONFUSED = [
    ("ignore_eos", "false", "boolean"),
    ("ignore_eos", "true", "boolean"),
    ("ignore_eos", 0, "boolean"),
    ("ignore_eos", 1, "boolean"),
    ("ignore_eos", [], "boolean"),
    ("logprobs", "yes", "boolean"),
    ("logprobs", "false", "boolean"),
    ("logprobs", 1, "boolean"),
    ("stop_token_ids", "123", "list of integer token ids"),
    ("stop_token_ids", 123, "list of integer token ids"),
    ("stop_token_ids", {"1": 2}, "list of integer token ids"),
    ("stop_token_ids", [1.5], "integer token id"),
    ("stop_token_ids", [2.0], "integer token id"),
    ("stop_token_ids", [True], "integer token id"),
    ("stop_token_ids", ["7"], "integer token id"),
    ("stop_token_ids", [None], "integer token id"),
    ("max_tokens", True, "integer"),
    ("max_tokens", "16", "integer"),
    ("max_tokens", 16.0, "integer"),
    ("top_k", False, "integer"),
    ("seed", True, "integer"),
    ("seed", "7", "integer"),
    ("temperature", True, "number"),
    ("temperature", "0.5", "number"),
    ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("top_p", False, "number"),
    ("top_p", [], "number"),
]
IDS = [f"{k}={v!r}" for k, v, _ in CONFUSED]


@pytest.mark.parametrize(("key", "value", "expected"), CONFUSED, ids=IDS)
def test_a_wrong_type_is_an_error_naming_the_key_and_type(key, value, expected):
    """From a mapping and from direct construction alike, a value of the wrong type raises
    ValueError naming the key and the type expected."""
    for build in (lambda: SamplingParams.from_mapping({key: value}), lambda: SamplingParams(**{key: value})):
        with pytest.raises(ValueError, match=key) as info:
            build()
        assert expected in str(info.value), str(info.value)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                     max_leaves=8)
_KIND = {"max_tokens": "int", "top_k": "int", "seed": "int", "temperature": "float", "top_p": "float",
         "logprobs": "bool", "ignore_eos": "bool", "stop_token_ids": "ids"}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(_KIND)), value=_JSON)
def test_any_json_value_is_kept_as_sent_or_refused_naming_the_key(key, value):
    """For any JSON value, a sampling key either keeps it with its own type (no truthy
    strings, no bool as a number, no string split into ids) or refuses it naming the key."""
    try:
        sp = SamplingParams.from_mapping({key: value})
    except ValueError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert key in message, message
        return
    kept = getattr(sp, key)
    kind = _KIND[key]
    if kind == "bool":
        assert isinstance(kept, bool)
        assert kept is value
    elif kind == "int" and not (key == "seed" and value is None):
        assert type(value) is int
        assert kept == value
    elif kind == "float":
        assert not isinstance(value, bool)
        assert isinstance(value, (int, float))
        assert math.isfinite(value)
    elif kind == "ids":
        assert value is None or isinstance(value, list)
        assert all(type(t) is int for t in (value or []))
        assert kept == tuple(value or ())


def test_the_rollout_config_and_the_gateway_refuse_confused_types():
    """``RolloutConfig.from_mapping`` (a script's or the trainer's rollout dict) and the
    gateway's own overrides go through the same check, naming the config key."""
    from agentloop_core.settings import RolloutConfig

    for key, value, _ in CONFUSED:
        with pytest.raises(ValueError, match=f"sampling_params.*{key}"):
            RolloutConfig.from_mapping({"sampling_params": {key: value}})
        with pytest.raises(ValueError, match=f"sampling_params.*{key}"):
            RolloutConfig.from_mapping({"sampling_params": {"max_tokens": 8}, "val_sampling_params": {key: value}})


def test_the_trainer_config_checks_sampling_values_at_load():
    """The trainer's sampling keys are checked when the config loads (not when the rollout
    starts, after the model is loaded): NaN, inf and out-of-range values name the config key."""
    pytest.importorskip("omegaconf", reason="the trainer config needs omegaconf: pip install agentloop-trainer")
    from agentloop_trainer.config.errors import ConfigError
    from agentloop_trainer.config.loading import load_config

    bad = ["actor_rollout_ref.rollout.top_p=nan", "actor_rollout_ref.rollout.temperature=inf",
           "actor_rollout_ref.rollout.val_kwargs.top_p=0", "actor_rollout_ref.rollout.top_k=-7",
           "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=0"]
    for override in bad:
        with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
            load_config([override])
    load_config(["actor_rollout_ref.rollout.temperature=0.7"])


# ---- the HTTP entry points --------------------------------------------------------------------


httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
# Request keys of /v1 that are not SamplingParams keys, with a confused value each.
V1_CONFUSED: list[tuple[str, Any, str]] = [
    ("n", True, "n"), ("presence_penalty", False, "presence_penalty"), ("best_of", True, "best_of"),
    ("stream_options", {"include_usage": "yes"}, "include_usage"), ("model", 123, "model"),
    ("top_logprobs", "5", "top_logprobs"), ("stream", "false", "stream"),
]


class CountingEngine(AsyncServerBase):
    """Generates two tokens; :attr:`seen` holds the sampling parameters of every call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 4096
        self.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.seen: list[SamplingParams] = []

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        self.seen.append(sp)
        return TokenOutput(token_ids=[5, 6], log_probs=None, stop_reason="length")


def test_every_http_entry_point_refuses_confused_types(tokenizer):
    """``/generate``, ``/v1/chat/completions`` and ``/v1/completions`` (engine server and
    gateway) and ``POST /sessions/<id>`` answer a confused value with 400 naming the key; the
    engine never sees it. ``/generate``'s prompt ids are strict integers too."""
    engine = CountingEngine(tokenizer)
    gateway = Gateway(engine, tokenizer, model_name="tiny")
    with ServerThread(engine) as srv, GatewayThread(gateway) as gw, httpx.Client(timeout=30) as http:
        for key, value, _ in CONFUSED:
            if isinstance(value, float) and not math.isfinite(value):
                continue  # not JSON; the finite checks are SamplingParams' own (above)
            r = http.post(f"{srv.url}/generate", json={"request_id": "r", "prompt_ids": [1, 2],
                                                       "sampling_params": {key: value}})
            assert r.status_code == 400, (key, value, r.status_code, r.text[:300])
            assert key in r.json()["error"]["message"]
            for url in (srv.url, gw.url):
                for path, prompt in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})):
                    if key == "logprobs":
                        continue  # an OpenAI key with its own meaning per endpoint: checked below
                    r = http.post(url + path, json={**prompt, "max_tokens": 2, key: value})
                    assert r.status_code == 400, (url, path, key, value, r.status_code, r.text[:300])
                    assert key in r.json()["error"]["message"], r.text[:300]
            r = http.post(f"{gw.url}/sessions/s-{len(engine.seen)}", json={"sampling_params": {key: value}},
                          headers={"Authorization": f"Bearer {gw.control_key}"})
            assert r.status_code == 400, (key, value, r.status_code, r.text[:300])
            assert key in r.json()["error"]["message"]
        for url in (srv.url, gw.url):
            for key, value, needle in V1_CONFUSED:
                r = http.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, key: value})
                assert r.status_code == 400, (url, key, value, r.status_code, r.text[:300])
                assert needle in r.json()["error"]["message"], r.text[:300]
            for path, prompt, value in (("/v1/chat/completions", {"messages": HI}, "yes"),
                                        ("/v1/completions", {"prompt": "hi"}, True)):
                r = http.post(url + path, json={**prompt, "max_tokens": 2, "logprobs": value})
                assert r.status_code == 400, (url, path, r.status_code, r.text[:300])
                assert "logprobs" in r.json()["error"]["message"]
        for ids in (["5", 6], [True, 6], [5.0, 6]):
            r = http.post(f"{srv.url}/generate", json={"request_id": "r", "prompt_ids": ids})
            assert r.status_code in (400, 422), (ids, r.status_code, r.text[:300])
            assert "prompt_ids" in r.text
        assert engine.seen == [], "a confused request reached the engine"
        # The real types still work, end to end.
        r = http.post(f"{srv.url}/generate", json={"request_id": "r", "prompt_ids": [1, 2], "sampling_params": {
            "ignore_eos": False, "logprobs": True, "stop_token_ids": [7, 8], "max_tokens": 2, "seed": 3}})
        assert r.status_code == 200, r.text[:300]
        assert engine.seen[-1].stop_token_ids == (7, 8)
        assert engine.seen[-1].ignore_eos is False


def test_gateway_overrides_are_checked_when_set():
    """``Gateway(sampling_overrides=...)`` and ``open_session(sampling_overrides=...)`` refuse a
    confused value when it is set, not on the first call that uses it."""
    from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer

    tokenizer = load_tiny_tokenizer()
    with pytest.raises(ValueError, match="ignore_eos"):
        Gateway(ScriptedServer(), tokenizer, sampling_overrides={"ignore_eos": "false"})
    gateway = Gateway(ScriptedServer(), tokenizer)
    with pytest.raises(ValueError, match="temperature"):
        gateway.open_session("s", sampling_overrides={"temperature": "hot"})
    gateway.open_session("s", sampling_overrides={"temperature": 0.5})
