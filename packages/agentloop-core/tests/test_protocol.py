"""Protocol records: validation that catches engine and loop bugs early."""

import pytest

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_core.registry import get_agent_loop_class, register, registered_names


def test_token_output_requires_one_logprob_per_token():
    with pytest.raises(ValueError, match="one log-prob per generated token"):
        TokenOutput(token_ids=[1, 2, 3], log_probs=[-0.1, -0.2])
    with pytest.raises(ValueError, match="stop_reason"):
        TokenOutput(token_ids=[1], stop_reason="eos")  # type: ignore[arg-type]


def test_sampling_params_unknown_key_names_closest():
    with pytest.raises(ValueError, match="did you mean 'max_tokens'"):
        SamplingParams.from_mapping({"max_token": 5})


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": -1}, "max_tokens must be a positive integer"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -3}, "top_k must be"),
    ],
)
def test_sampling_params_out_of_range(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_mapping(params)


def test_sampling_params_roundtrip_and_stop_ids_tuple():
    sp = SamplingParams.from_mapping({"max_tokens": 7, "stop_token_ids": [3, 4], "temperature": 0})
    assert sp.stop_token_ids == (3, 4)
    assert SamplingParams.from_mapping(sp.as_dict()) == sp
    assert sp.replace(max_tokens=2).max_tokens == 2


def test_capabilities_as_dict():
    caps = ServerCapabilities(sleep=True)
    assert caps.as_dict()["sleep"] is True
    assert caps.as_dict()["weight_update"] is False


def test_agent_loop_output_invariants():
    with pytest.raises(ValueError, match="response_mask has 1 entries"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1])
    with pytest.raises(ValueError, match="only 0"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[2])
    with pytest.raises(ValueError, match="response_logprobs has 1"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 0], response_logprobs=[0.0])
    failed = AgentLoopOutput.failure([1, 2], RuntimeError("boom"), sample_index=3)
    assert failed.failed
    assert failed.metrics["error"] == "RuntimeError: boom"
    assert failed.metrics["sample_index"] == 3
    assert failed.response_ids == []


def test_registry_unknown_name_lists_known_names():
    with pytest.raises(KeyError) as info:
        get_agent_loop_class("no_such_loop")
    message = str(info.value)
    assert "no_such_loop" in message
    assert "single_turn_agent" in message
    assert "@agentloop_core.register" in message


def test_registry_entry_point_and_duplicate_name():
    # single_turn_agent is declared as an entry point in agentloop-core's pyproject.
    assert "single_turn_agent" in registered_names()
    assert get_agent_loop_class("single_turn_agent").__name__ == "SingleTurnAgentLoop"

    @register("test_registry_dup")
    class First(AgentLoopBase):
        async def run(self, sampling_params, **row):
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):

        @register("test_registry_dup")
        class Second(AgentLoopBase):
            async def run(self, sampling_params, **row):
                raise NotImplementedError

    assert get_agent_loop_class("test_registry_dup") is First
