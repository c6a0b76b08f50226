"""The worker tells an engine with ``capabilities.forget_session`` when each trajectory is over:
every request id the trajectory's loop generated with, once, however the sample ended."""

from __future__ import annotations

import asyncio
import collections
import logging

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.protocol import ServerCapabilities
from agentloop_core.runtime import AgentLoopWorker
from agentloop_core.runtime.sessions import SessionRecordingServer
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.loops import TEST_CHAT_AGENT

CONFIG = {"sampling_params": {"max_tokens": 4, "temperature": 1.0}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


class ForgettingServer(ScriptedServer):
    """Records each ``forget_session`` and which request ids were still generating then."""

    capabilities = ServerCapabilities(logprobs=True, forget_session=True)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.forgotten: list[str] = []
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.forgotten_while_generating: list[str] = []
        self.hang_second_turn = False

    async def generate(self, request_id, prompt_ids, sampling_params=None, **kwargs):
        self.in_flight[request_id] += 1
        try:
            if self.hang_second_turn and any(c.request_id == request_id for c in self.calls):
                await asyncio.sleep(3600)
            return await super().generate(request_id, prompt_ids, sampling_params, **kwargs)
        finally:
            self.in_flight[request_id] -= 1

    def forget_session(self, request_id: str) -> None:
        if self.in_flight[request_id]:
            self.forgotten_while_generating.append(request_id)
        self.forgotten.append(request_id)


def rows(n: int, **extra) -> list[dict]:
    return [{"agent_name": TEST_CHAT_AGENT, "raw_prompt": [{"role": "user", "content": f"q {i}"}], **extra}
            for i in range(n)]


async def test_each_finished_trajectory_is_forgotten_once_after_its_last_turn(tokenizer):
    server = ForgettingServer(eos_token_id=tokenizer.eos_token_id)
    worker = AgentLoopWorker(server, tokenizer, {**CONFIG, "sampling_seed": 7})
    outputs = await worker.generate_sequences(rows(6, observation="tool says 4"))
    assert not any(o.failed for o in outputs)
    used = {c.request_id for c in server.calls}
    assert len(server.calls) == 12
    assert len(used) == 6
    assert sorted(server.forgotten) == sorted(used)
    assert sorted(server.forgotten) == sorted({o.extra_fields["request_id"] for o in outputs})
    assert server.forgotten_while_generating == []


async def test_failed_and_timed_out_trajectories_are_forgotten_too(tokenizer):
    server = ForgettingServer(eos_token_id=tokenizer.eos_token_id)
    worker = AgentLoopWorker(server, tokenizer, CONFIG)
    failed = await worker.generate_sequences(rows(3, fail=True))
    assert all(o.failed for o in failed)
    assert sorted(server.forgotten) == sorted({c.request_id for c in server.calls})

    server = ForgettingServer(eos_token_id=tokenizer.eos_token_id)
    server.hang_second_turn = True
    worker = AgentLoopWorker(server, tokenizer, {**CONFIG, "sample_timeout_s": 0.5})
    timed_out = await worker.generate_sequences(rows(2, observation="x"))
    assert all(o.failed for o in timed_out)
    assert len(server.calls) == 2  # first turns done, second turns cut by the timeout
    assert sorted(server.forgotten) == sorted({c.request_id for c in server.calls})
    assert server.forgotten_while_generating == []  # the cancelled turn had unwound first


async def test_an_engine_without_the_flag_is_called_as_before(tokenizer):
    server = ScriptedServer(eos_token_id=tokenizer.eos_token_id)
    assert not hasattr(server, "forget_session")
    worker = AgentLoopWorker(server, tokenizer, CONFIG)
    assert worker.loop_server is server
    outputs = await worker.generate_sequences(rows(2))
    assert not any(o.failed for o in outputs)


async def test_a_forget_that_raises_costs_a_warning_not_the_sample(tokenizer, caplog):
    class Broken(ForgettingServer):
        def forget_session(self, request_id: str) -> None:
            raise ConnectionError("engine went away")

    server = Broken(eos_token_id=tokenizer.eos_token_id)
    worker = AgentLoopWorker(server, tokenizer, CONFIG)
    with caplog.at_level(logging.WARNING, logger="agentloop_core.runtime.sessions"):
        outputs = await worker.generate_sequences(rows(1))
    assert not outputs[0].failed
    assert "forget_session" in caplog.text
    assert "engine went away" in caplog.text


async def test_generate_outside_a_trajectory_records_nothing(tokenizer):
    server = ForgettingServer(eos_token_id=tokenizer.eos_token_id)
    recording = SessionRecordingServer(server)
    out = await recording.generate("loose", [1, 2, 3], {"max_tokens": 2})
    assert out.token_ids
    assert server.forgotten == []
    assert recording.capabilities.forget_session  # forwarded, as every other attribute
