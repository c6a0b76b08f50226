"""Agents written with real agent SDKs train unchanged under ``http_agent``: the OpenAI Agents SDK
(Responses API), a plain ``anthropic`` tool-use loop (Messages API) and pydantic-ai (Chat
Completions), each the agent of its example in ``examples/``.

For each SDK: its mask-1 tokens are exactly what the engine generated on each call, with the
engine's log-probs, and a conversation the SDK resends whole stays one segment; then
``agentloop train`` runs two GRPO steps of the example's config on the random tiny model.

A failure of the exact-token test usually means the gateway's translation of that API (the
request into chat messages, or the reply back into the SDK's items) does not round-trip: the
recorded calls' ``extends_previous`` and the decoded prompt show where it diverged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='needs the gateway: pip install "agentloop-engines[server]"')
pytest.importorskip("openai", reason='needs openai: pip install "agentloop-trainer[test]"')

from agentloop_core.testing import load_tiny_tokenizer  # noqa: E402
from agentloop_engines.serving.gateway import Gateway  # noqa: E402
from agentloop_engines.serving.http_agent import HTTPAgentLoop, close_gateways  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import calculator_call, generated_runs, scripted  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SAMPLING = {"temperature": 1.0, "max_tokens": 64}


@dataclass(frozen=True)
class Harness:
    """One SDK's example and what the gateway should record of it."""

    module: str
    """The SDK's import name (skipped without it)."""
    install: str
    """What to install for it."""
    example: str
    """The folder under ``examples/`` whose ``agent.py:run`` is the agent."""
    endpoint: str
    """The API the gateway records for its calls."""
    streams: bool = False
    """The example also has ``run_streamed`` (each call streamed)."""

    @property
    def agent(self) -> str:
        return self.entry("run")

    def entry(self, name: str) -> str:
        return f"{REPO / 'examples' / self.example / 'agent.py'}:{name}"

    def require(self) -> None:
        pytest.importorskip(self.module, reason=f"needs {self.module}: pip install {self.install}")


HARNESSES = {
    "openai-agents": Harness("agents", '"agentloop-trainer[test]" (openai-agents)', "openai_agents_calculator",
                             "responses", streams=True),
    "anthropic": Harness("anthropic", '"agentloop-trainer[test]" (anthropic)', "anthropic_calculator", "messages",
                         streams=True),
    "pydantic-ai": Harness("pydantic_ai", '"agentloop-trainer[test]" (pydantic-ai-slim[openai])',
                           "pydantic_ai_calculator", "chat.completions"),
}


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _stop_gateways():
    yield
    close_gateways()


@pytest.fixture
def recorded(monkeypatch) -> list:
    """Every call the gateway recorded, in order, as its sessions close (endpoint and request
    body included), to show what the SDK sent."""
    calls: list = []
    close = Gateway.close_session

    def spy(self, session_id):
        closed = close(self, session_id)
        calls.extend(closed)
        return closed

    monkeypatch.setattr(Gateway, "close_session", spy)
    return calls


ROW = {"index": 3, "raw_prompt": [
    {"role": "system", "content": "Solve the problem. Call the calculator, then answer as #### N."},
    {"role": "user", "content": "Ann has 6 bags with 7 apples each and eats none. How many apples?"}]}


@pytest.mark.parametrize(("sdk", "entry"), [(sdk, entry) for sdk, h in HARNESSES.items()
                                             for entry in ("run", "run_streamed")[: 1 + h.streams]])
async def test_an_sdk_agent_trains_on_the_engine_tokens(sdk, entry, tok, recorded):
    """The SDK's agent calls the calculator twice (two hermes tool calls, each answered with a
    tool result) and then answers: three model calls, each extending the last, so one segment
    whose mask-1 runs are exactly the engine's generated ids per call, with its log-probs, and
    whose mask-0 tokens hold both tool results as the chat template renders them. Streamed
    (``run_streamed``) or not, the recorded ids are the same."""
    harness = HARNESSES[sdk]
    harness.require()
    server = scripted(tok, [calculator_call("6*7"), calculator_call("42-0"), "#### 42"])
    outputs = await HTTPAgentLoop(server, tok, {"agent": harness.entry(entry)}).run(SAMPLING, **ROW)
    assert all(call.request.get("stream", False) is (entry == "run_streamed") for call in recorded)

    assert [call.endpoint for call in recorded] == [harness.endpoint] * 3
    assert [call.extra.get("extends_previous") for call in recorded[1:]] == [True, True], (
        "a call did not extend the previous one: the SDK's resent conversation did not render to the "
        "recorded prompt + generation")
    assert len(outputs) == 1, "each call extends the previous one: one segment"
    (out,) = outputs
    engine_ids = [call.output.token_ids for call in server.calls]
    assert len(engine_ids) == 3
    assert generated_runs(out) == engine_ids
    lps = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m]
    assert lps == [lp for call in server.calls for lp in call.output.log_probs]
    text = tok.decode(out.prompt_ids + out.response_ids)
    assert "<tool_response>\n42\n</tool_response>" in text  # 6*7 and 42-0, both run by the agent's tool
    assert text.count("<tool_response>") == 2
    assert "Call the calculator, then answer as #### N." in tok.decode(out.prompt_ids)
    assert out.metrics["http_calls"] == 3
    assert out.metrics["finished"] == 1
    assert out.metrics["tool_calls"] == 2
    assert all(call.sampling_params.temperature == 1.0 and call.sampling_params.logprobs for call in server.calls)


@pytest.mark.parametrize("sdk", list(HARNESSES))
async def test_a_reply_cut_at_max_tokens_ends_the_episode(sdk, tok, recorded):
    """A reply cut at the trainer's ``max_tokens`` (a Responses status ``incomplete``, a Messages
    ``stop_reason`` ``max_tokens``, a chat ``finish_reason`` ``length``) ends the agent's run
    with ``finished`` 0 instead of failing the sample: the OpenAI Agents SDK raises
    ``ModelBehaviorError`` on an incomplete response, which its example agent catches. The
    truncated call is still trained on, its kept ids exactly the engine's."""
    harness = HARNESSES[sdk]
    harness.require()
    server = scripted(tok, ["one two three four five six seven eight nine ten eleven twelve"])
    (out,) = await HTTPAgentLoop(server, tok, {"agent": harness.agent}).run({**SAMPLING, "max_tokens": 4}, **ROW)
    assert [call.finish_reason for call in recorded] == ["length"]
    assert generated_runs(out) == [server.calls[0].output.token_ids]
    assert len(server.calls[0].output.token_ids) == 4
    assert out.metrics["finished"] == 0
    assert out.metrics["tool_calls"] == 0


def _train(tmp_path, harness: Harness, model_path: Path) -> list[dict]:
    from agentloop_trainer.cli import main
    from agentloop_trainer.data import write_parquet_rows
    from agentloop_trainer.task import dataset_row, make_problems

    # The rows examples/langgraph_calculator/make_data.py --agent-name http_agent writes.
    rows = [{**dataset_row(p, "train"), "agent_name": "http_agent"} for p in make_problems(6, seed=1)]
    write_parquet_rows(rows[:4], tmp_path / "train.parquet")
    write_parquet_rows(rows[4:], tmp_path / "val.parquet")
    out = tmp_path / "out"
    assert main([
        "train", "--config", str(REPO / "examples" / harness.example / "config.yaml"),
        f"model.path={model_path}", f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'val.parquet'}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        # The example's agent path is relative to the repository root; the test may run elsewhere.
        f"actor_rollout_ref.rollout.agent.loops.http_agent.agent={harness.agent}",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=60",
        "actor_rollout_ref.actor.lr=1e-2", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.val_before_train=false", "trainer.progress_bar=false", f"trainer.output_dir={out}",
        "trainer.experiment_name=sdk",
    ]) == 0
    steps = [json.loads(line) for line in (out / "sdk" / "metrics.jsonl").read_text().splitlines()]
    return [s for s in steps if "actor/pg_loss" in s]


@pytest.mark.parametrize("sdk", list(HARNESSES))
def test_agentloop_train_runs_the_sdk_example(sdk, random_model_path, tmp_path):
    """Two GRPO steps of the example's config with its agent on the random tiny model: every
    trajectory made at least one call through the SDK and none failed (a failure is logged with
    the agent's exception in the run's log)."""
    harness = HARNESSES[sdk]
    harness.require()
    train_steps = _train(tmp_path, harness, random_model_path)
    assert [s["step"] for s in train_steps] == [1, 2]
    for s in train_steps:
        assert s["rollout/num_failed"] == 0
        assert s["agent_loop/http_calls/mean"] >= 1
        assert "agent_loop/finished/mean" in s
