"""The no-code mode: ``pytest --pyargs agentloop_conformance --agentloop-engine=... |
--agentloop-tokenizer=... | --agentloop-loop=...``. Suites whose option is absent skip with the
reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentloop_conformance.agent_loop import AgentLoopConformanceTests
from agentloop_conformance.engine import EngineConformanceTests
from agentloop_conformance.hooks import EngineTarget
from agentloop_conformance.plugin import (
    call_maybe_async,
    load_object,
    load_replies,
    load_tokenizer,
    make_loop_factory,
)
from agentloop_conformance.tokenization import TokenizationConformanceTests
from agentloop_conformance.vision_prompts import default_vision_prompt


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def engine_target(request: Any):
    spec = request.config.getoption("--agentloop-engine")
    if not spec:
        pytest.skip("no engine given: pass --agentloop-engine=pkg.module:factory")
    made = await call_maybe_async(load_object(spec, "--agentloop-engine"))
    target = made if isinstance(made, EngineTarget) else EngineTarget(made)
    yield target
    for engine in (target.engine, target.placeholder_engine):
        close = getattr(engine, "close", None)
        if callable(close):
            await call_maybe_async(close)


class TestEngine(EngineConformanceTests):
    @pytest.fixture
    def engine(self, engine_target: EngineTarget) -> Any:
        return engine_target.engine

    @pytest.fixture
    def reference_log_probs(self, engine_target: EngineTarget) -> Any:
        return engine_target.reference_log_probs

    @pytest.fixture
    def named_weights(self, engine_target: EngineTarget) -> Any:
        return engine_target.named_weights

    @pytest.fixture
    def vision_prompt(self, engine_target: EngineTarget) -> Any:
        return engine_target.vision_prompt or default_vision_prompt(engine_target.engine)

    @pytest.fixture
    def placeholder_engine(self, engine_target: EngineTarget) -> Any:
        return engine_target.placeholder_engine


class TestTokenizer(TokenizationConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, request: Any) -> Any:
        spec = request.config.getoption("--agentloop-tokenizer")
        if not spec:
            pytest.skip("no tokenizer given: pass --agentloop-tokenizer=PATH (a Hugging Face tokenizer folder)")
        return load_tokenizer(spec)

    @pytest.fixture
    def chat_template(self, request: Any) -> str | None:
        path = request.config.getoption("--agentloop-chat-template")
        return Path(path).read_text() if path else None


class TestAgentLoop(AgentLoopConformanceTests):
    @pytest.fixture
    def agent_loop_factory(self, request: Any) -> Any:
        spec = request.config.getoption("--agentloop-loop")
        if not spec:
            pytest.skip("no agent loop given: pass --agentloop-loop=pkg.module:factory (server -> AgentLoopBase)")
        tokenizer = None
        if request.config.getoption("--agentloop-tokenizer"):
            tokenizer = request.getfixturevalue("loop_tokenizer")
        return make_loop_factory(load_object(spec, "--agentloop-loop"), tokenizer)

    @pytest.fixture
    def loop_tokenizer(self, request: Any) -> Any:
        """--agentloop-tokenizer (with --agentloop-chat-template as its template) for the loop."""
        tokenizer = load_tokenizer(request.config.getoption("--agentloop-tokenizer"))
        path = request.config.getoption("--agentloop-chat-template")
        if path:
            tokenizer.chat_template = Path(path).read_text()
        return tokenizer

    @pytest.fixture
    def scripted_replies(self, request: Any) -> Any:
        spec = request.config.getoption("--agentloop-replies")
        return load_replies(spec) if spec else None

    @pytest.fixture
    def real_engine(self, request: Any) -> Any:
        if not request.config.getoption("--agentloop-engine"):
            return None
        return request.getfixturevalue("engine_target").engine
