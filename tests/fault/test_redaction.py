"""Secrets inside strings never reach a trace: credentials in URLs (``https://user:pass@host``),
secret query-string keys (``?api_key=``, ``token=``, ``key=``...), ``Bearer`` tokens in free
text, and exception messages recorded in spans (which repeat whatever the failing code saw)."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.tracing import make_tracer, redact

# Long enough that it cannot occur in the surrounding text by chance.
_secret = st.text(string.ascii_letters + string.digits + "-_.~", min_size=12, max_size=40).map(lambda s: "S3CR" + s)
_query_key = st.sampled_from(["api_key", "apikey", "token", "access_token", "key", "client_secret", "password",
                              "refresh_token", "X-Api-Key", "sig", "auth"])


def _dump(value) -> str:
    return json.dumps(redact(value), ensure_ascii=False)


@settings(max_examples=200, deadline=None)
@given(_secret, st.sampled_from(["https", "http", "postgresql", "redis", "git+https"]))
def test_credentials_in_urls(secret, scheme):
    record = {"url": f"{scheme}://alice:{secret}@db.example.com:5432/x?y=1", "msg": f"to {scheme}://{secret}@h/"}
    out = _dump(record)
    assert secret not in out
    assert "db.example.com:5432/x?y=1" in out


@settings(max_examples=200, deadline=None)
@given(_secret, _query_key, st.sampled_from(["?", "&", "#", ";"]))
def test_secret_query_string_keys(secret, key, sep):
    url = f"https://api.example.com/v1/chat?model=m{sep}{key}={secret}&limit=5"
    out = _dump({"request": url, "also": [f"POST body: {key}={secret}", {"nested": f"'{key}': '{secret}'"}]})
    assert secret not in out
    assert "model=m" in out
    assert "limit=5" in out


@settings(max_examples=200, deadline=None)
@given(_secret)
def test_bearer_tokens_anywhere_in_text(secret):
    out = _dump({"note": f"sent headers {{'Authorization': 'Bearer {secret}'}} to the API"})
    assert secret not in out
    assert "to the API" in out


def test_ordinary_key_values_survive():
    text = "max_tokens=5 temperature=0.7 num_tokens: 12 https://example.com/a?page=2&sort=asc"
    assert redact({"x": text}) == {"x": text}


@settings(max_examples=50, deadline=None)
@given(_secret)
def test_exception_text_recorded_in_a_span_is_redacted(tmp_path_factory, secret):
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    tracer = make_tracer({"backend": "jsonl", "path": str(path)})
    for message in (f"401 from https://api.example.com/v1?api_key={secret}",
                    f"the server rejected key {secret}",  # only the attribute says it is a secret
                    f"could not connect to https://bob:{secret}@db.internal/"):
        with pytest.raises(RuntimeError), tracer.span("call_api", api_key=secret):
            raise RuntimeError(message)
    tracer.close()
    text = path.read_text()
    assert secret not in text
    assert text.count('"error"') == 3
    assert "RuntimeError" in text
