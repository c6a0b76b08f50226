"""Secrets never reach logs, traces, trajectories or checkpoints: a traced tool-agent rollout
with an authenticated MCP server (and a loop that traces its own API credentials) is grepped
end to end for the secret values."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import tool_call, tool_engine

from agentloop_core import AgentLoopManager, register
from agentloop_tools.agent_loop import ToolAgentLoop

MCP_TOKEN = "mcp-tok-SECRET-7a6b5c4d3e2f"
API_KEY = "sk-SECRET-api-key-1a2b3c4d5e"
HEADER_KEY = "hdr-SECRET-9z8y7x6w"
SECRETS = (MCP_TOKEN, API_KEY, HEADER_KEY)


@register("fault_secret_loop")
class SecretTracingLoop(ToolAgentLoop):
    """A user loop that calls some external API first and traces the request it made,
    credentials included, as careless code does: the tracer must redact them."""

    async def run(self, sampling_params: Any, **row: Any):
        with self.tracer.span("external_api", url="https://api.example.com/v1", api_key=API_KEY,
                              headers={"Authorization": f"Bearer {API_KEY}", "X-Trace": "ok"},
                              note=f"Bearer {API_KEY}") as span:
            span["status"] = 200
        return await super().run(sampling_params, **row)


def _grep(root: Path) -> list[str]:
    """Files under ``root`` holding any secret value (raw bytes, so binary stores count)."""
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path.relative_to(root)}: {s}" for s in SECRETS if s.encode() in data]
    return hits


@pytest.mark.parametrize("backend", ["jsonl", "mlflow"])
async def test_traced_run_with_authenticated_mcp_leaks_no_secret(backend, tokenizer, mcp_server, tmp_path, caplog,
                                                                  monkeypatch):
    from agentloop_tools.mcp import aload_mcp_tools

    if backend == "mlflow":
        pytest.importorskip("mlflow", reason='MLflow tracing needs: pip install "agentloop-core[mlflow]"')
        monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        tracer = {"backend": "mlflow", "tracking_uri": f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}",
                  "experiment": "secrets", "artifact_location": str(tmp_path / "out" / "artifacts")}
    else:
        tracer = {"backend": "jsonl", "path": str(tmp_path / "out" / "spans.jsonl")}
    caplog.set_level(logging.DEBUG)

    server = mcp_server(token=MCP_TOKEN)
    good = {"url": server.url, "auth_token": MCP_TOKEN, "headers": {"X-Api-Key": HEADER_KEY},
            "connect_retries": 2, "retry_backoff_s": 0.05}
    tools = await aload_mcp_tools({"mcpServers": {"calc": good}})
    # A second connection whose token the server rejects: its failure must be reported
    # without the token in the message.
    wrong = dict(good, auth_token=MCP_TOKEN[::-1], headers={"X-Api-Key": HEADER_KEY})
    with pytest.raises(ConnectionError) as info:
        await aload_mcp_tools({"mcpServers": {"calc": wrong}})
    assert not any(s in str(info.value) or s[::-1] in str(info.value) for s in SECRETS)

    engine = tool_engine(tokenizer, lambda rid, i: tool_call("add", a=2, b=3) if i == 0 else "#### 5")
    cfg = {"default_agent_loop": "fault_secret_loop", "tools": tools, "response_length": 1024,
           "sampling_params": {"max_tokens": 60}, "api_key": API_KEY}
    manager = AgentLoopManager(engine, tokenizer, cfg, tracer=tracer)
    try:
        batch = await manager.agenerate_sequences([{"raw_prompt": [{"role": "user", "content": "2+3?"}]}] * 4,
                                                   step=1)
    finally:
        manager.shutdown()
    assert batch.num_failed == 0, [m.get("error") for m in batch.sample_metrics]
    assert [m["content"] for m in batch.extra_fields[0]["messages"] if m["role"] == "tool"] == ["5"]

    out = tmp_path / "out"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files, "the tracer wrote nothing; the grep below would prove nothing"
    spans = b"".join(p.read_bytes() for p in files)
    assert b"external_api" in spans
    assert b"X-Trace" in spans
    assert _grep(out) == []
    assert not any(s in caplog.text for s in SECRETS), [s for s in SECRETS if s in caplog.text]
    assert not any(s in repr(r) for r in batch.sample_metrics + batch.extra_fields for s in SECRETS)

    # What a trainer checkpoints from a rollout (metrics history, per-sample records).
    torch = pytest.importorskip("torch", reason="checkpoints need torch")
    ckpt = pytest.importorskip("agentloop_trainer.checkpoint", reason="agentloop-trainer is not installed")
    ckpt.save_checkpoint(tmp_path / "ckpt", 1, {"w": torch.ones(1)}, {},
                         {"history": [batch.metrics], "samples": list(batch.sample_metrics)})
    assert _grep(tmp_path / "ckpt") == []


def test_secret_reprs_and_toolset_never_show_values():
    from agentloop_tools.mcp_config import parse_mcp_servers

    [server] = parse_mcp_servers({"mcpServers": {"s": {"url": f"http://u:{API_KEY}@127.0.0.1:1/mcp?key={API_KEY}",
                                                       "auth_token": MCP_TOKEN, "headers": {"X": HEADER_KEY}}}})
    text = repr(server) + str(server) + server.display_url
    assert not any(s in text for s in SECRETS), text
