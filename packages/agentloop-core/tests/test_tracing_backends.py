"""Tracing backends: JSONL, MLflow on sqlite, make_tracer, secret redaction."""

from __future__ import annotations

import pickle
import re

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.runtime import AgentLoopWorker
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.loops import TEST_CHAT_AGENT
from agentloop_core.tracing import NullTracer, current_tags, is_secret_key, make_tracer, redact, trace_context
from agentloop_core.tracing.jsonl import JsonlTracer, read_spans


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def rows(n):
    return [
        {
            "agent_name": TEST_CHAT_AGENT,
            "raw_prompt": [{"role": "user", "content": f"q{i}"}],
            "rollout_n": i % 2,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "key",
    [
        "api_key",
        "apiKey",
        "Authorization",
        "hf_token",
        "token",
        "access_token",
        "client_secret",
        "password",
        "X-Api-Key",
        "control_key",
        "controlKey",
        "session_key",
        "X-Agentloop-Session-Key",
    ],
)
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["max_tokens", "prompt_token_ids", "num_tokens", "eos_token", "pad_token", "tokens", "keyword", "author"],
)
def test_not_secret_keys(key):
    assert not is_secret_key(key)


def test_redact_recurses_and_masks_bearer_values():
    out = redact(
        {"headers": {"Authorization": "Bearer abc"}, "args": [{"api_key": "k", "q": 1}], "note": "Bearer xyz"}
    )
    assert out == {
        "headers": {"Authorization": "[REDACTED]"},
        "args": [{"api_key": "[REDACTED]", "q": 1}],
        "note": "[REDACTED]",
    }


def test_trace_contexts_nest_restore_and_can_be_entered_again():
    """The outermost context's tags are its own keyword dict (one dict per sample in flight);
    an inner one merges over it, and each exit gives back what was there."""
    outer, inner = trace_context(step=1, sample_index=4), trace_context(sample_index=5, rollout_n=2)
    assert current_tags() == {}
    for _ in range(2):
        with outer:
            seen = current_tags()
            seen["step"] = 99  # a copy: changing it changes no span's tags
            with inner:
                assert current_tags() == {"step": 1, "sample_index": 5, "rollout_n": 2}
            assert current_tags() == {"step": 1, "sample_index": 4}
        assert current_tags() == {}
    with inner:
        assert current_tags() == {"sample_index": 5, "rollout_n": 2}


def test_jsonl_tracer_writes_tags_nesting_errors_and_redacts(tmp_path):
    path = tmp_path / "sub" / "spans.jsonl"
    tracer = JsonlTracer(path)
    with trace_context(step=3, sample_index=7, rollout_n=1):
        with tracer.span("outer", api_key="sk-123", value=float("nan")) as rec:
            rec["late"] = 5
            with tracer.span("inner"):
                pass
        with pytest.raises(KeyError), tracer.span("broken"):
            raise KeyError("x")
    tracer.close()
    inner, outer, broken = read_spans(path)
    assert [s["name"] for s in (inner, outer, broken)] == ["inner", "outer", "broken"]
    assert all((s["step"], s["sample_index"], s["rollout_n"]) == (3, 7, 1) for s in (inner, outer, broken))
    assert inner["parent_id"] == outer["span_id"]
    assert outer["parent_id"] is None
    assert outer["api_key"] == "[REDACTED]"
    assert outer["value"] is None
    assert outer["late"] == 5
    assert broken["error"].startswith("KeyError")
    assert outer["duration_s"] >= inner["duration_s"] >= 0
    assert "sk-123" not in path.read_text()
    clone = pickle.loads(pickle.dumps(tracer))
    assert isinstance(clone, JsonlTracer)
    assert clone.path == path


async def test_worker_spans_carry_step_sample_index_rollout_n(tmp_path, tokenizer):
    path = tmp_path / "spans.jsonl"
    worker = AgentLoopWorker(
        ScriptedServer(),
        tokenizer,
        {"sampling_params": {"max_tokens": 2}},
        tracer={"backend": "jsonl", "path": str(path)},
    )
    await worker.generate_sequences(rows(4), step=9, sample_offset=100)
    spans = read_spans(path)
    roots = {s["sample_index"]: s for s in spans if s["name"] == "agent_loop"}
    assert sorted(roots) == [100, 101, 102, 103]
    gens = [s for s in spans if s["name"] == "generate"]
    assert len(gens) == 4
    for g in gens:
        root = roots[g["sample_index"]]
        assert g["parent_id"] == root["span_id"]
        assert g["step"] == 9
        assert g["rollout_n"] == (g["sample_index"] - 100) % 2
        assert root["agent_name"] == TEST_CHAT_AGENT


def test_make_tracer_switches_and_validates(tmp_path):
    assert isinstance(make_tracer(None), NullTracer)
    assert isinstance(make_tracer({"backend": "none"}), NullTracer)
    assert isinstance(make_tracer({"backend": "jsonl", "path": str(tmp_path / "a.jsonl")}), JsonlTracer)
    with pytest.raises(ValueError, match="unknown tracing backend 'wandb'.*none, jsonl, mlflow"):
        make_tracer({"backend": "wandb"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['file'\].*path"):
        make_tracer({"backend": "jsonl", "file": "x"})


@pytest.mark.slow  # MLflow import + sqlite schema creation: ~10 s idle, ~30 s on busy shared cores
async def test_mlflow_tracer_on_sqlite_reads_back(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("mlflow", reason='needs pip install "agentloop-core[mlflow]"')
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    db = tmp_path / "mlflow.db"
    tracer = make_tracer(
        {"backend": "mlflow", "tracking_uri": f"sqlite:///{db}", "experiment": "rollouts-test"}
    )
    worker = AgentLoopWorker(
        ScriptedServer(), tokenizer, {"sampling_params": {"max_tokens": 2}}, tracer=tracer
    )
    with trace_context(auth_token="sk-secret"):
        outputs = await worker.generate_sequences(rows(3), step=2)
    assert not any(o.failed for o in outputs)
    traces = tracer.search()
    assert len(traces) == 3
    seen = set()
    for trace in traces:
        spans = {s.name: s for s in trace.data.spans}
        assert set(spans) == {"agent_loop", "generate"}
        root, gen = spans["agent_loop"], spans["generate"]
        assert gen.parent_id == root.span_id
        assert root.attributes["step"] == 2
        assert gen.attributes["step"] == 2
        assert root.attributes["auth_token"] == "[REDACTED]"
        seen.add((root.attributes["sample_index"], root.attributes["rollout_n"]))
    assert seen == {(0, 0), (1, 1), (2, 0)}
    assert tracer.artifact_location == str(tmp_path / "mlflow-artifacts")
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.slow  # MLflow import + sqlite schema creation
def test_mlflow_exception_events_and_status_are_redacted(tmp_path, monkeypatch):
    """MLflow records an exception raised through a span as a span event (``exception.message``,
    ``exception.stacktrace``) and as the span's status description; secrets in that text must be
    masked as in attributes. Grepped in the stored trace and in every file MLflow wrote."""
    pytest.importorskip("mlflow", reason='needs pip install "agentloop-core[mlflow]"')
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    secrets = ["sk-url-SECRET-41b2", "pw-SECRET-77c9", "bearer-SECRET-0d1e", "known-SECRET-5f6a"]
    tracer = make_tracer({"backend": "mlflow", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                          "experiment": "exceptions"})
    messages = [f"401 from https://api.example.com/v1/chat?model=m&api_key={secrets[0]}",
                f"could not connect to postgresql://bob:{secrets[1]}@db.internal:5432/x",
                f"server said: Authorization: Bearer {secrets[2]} is expired",
                f"the server rejected {secrets[3]}"]  # only the enclosing span's api_key says it is a secret
    for message in messages:
        with (
            pytest.raises(RuntimeError, match=re.escape(message)),  # the caller gets it unmasked
            tracer.span("agent_loop", api_key=secrets[3]),
            tracer.span("call_api"),
        ):
            raise RuntimeError(message)
    traces = tracer.search()
    assert len(traces) == 4
    dumped = "".join(trace.to_json() for trace in traces)
    assert "RuntimeError" in dumped
    assert "db.internal:5432" in dumped
    assert [s for s in secrets if s in dumped] == []
    events = [e for t in traces for s in t.data.spans for e in s.events if e.name == "exception"]
    assert events
    assert all("exception.stacktrace" in e.attributes for e in events)
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets)]
    assert leaked == [], leaked


def test_a_secret_of_an_enclosing_span_is_masked_in_nested_spans(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracer = make_tracer({"backend": "jsonl", "path": str(path)})
    secret = "nested-SECRET-8e7d6c"
    with (
        pytest.raises(ValueError, match="the API refused"),
        tracer.span("agent_loop", auth_token=secret),
        tracer.span("tool", note="calls the API"),
    ):
        raise ValueError(f"the API refused {secret}")  # nothing in this span says it is a secret
    tracer.close()
    text = path.read_text()
    assert secret not in text
    assert text.count("ValueError: the API refused [REDACTED]") == 2


def test_tracing_package_keeps_its_public_names_and_imports_no_backend():
    import subprocess
    import sys

    code = ("import sys, agentloop_core.tracing as t; "
            "assert sorted(t.__all__) == sorted(['REDACTED', 'TRACER_BACKENDS', 'NullTracer', 'Tracer', "
            "'current_tags', 'is_secret_key', 'make_tracer', 'redact', 'redact_text', 'trace_context']), t.__all__; "
            "assert all(hasattr(t, n) for n in t.__all__); "
            "assert 'mlflow' not in sys.modules")
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
