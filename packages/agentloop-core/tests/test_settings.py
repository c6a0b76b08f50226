"""``RolloutConfig``: one frozen record built from a mapping at the edge, checked once, each loop's
config built once (typed for a loop with a config class), and it pickles as it is."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, ClassVar

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core import AgentLoopBase, AgentLoopOutput, RolloutConfig, SamplingParams, register
from agentloop_core.registry import get_agent_loop_class
from agentloop_core.testing.loops import TEST_CHAT_AGENT


@dataclasses.dataclass(frozen=True)
class GreetConfig:
    """A third-party loop's config class without ``from_mapping``: its fields are read."""

    greeting: str = "hi"
    response_length: int | None = None


@register("settings_test_greeter")
class GreeterLoop(AgentLoopBase):
    config_class: ClassVar[type] = GreetConfig

    async def run(self, sampling_params: Any, **row: Any) -> AgentLoopOutput:  # pragma: no cover - not run
        raise NotImplementedError


def test_a_mapping_becomes_the_record_with_sampling_params_merged():
    record = RolloutConfig.from_mapping({
        "sampling_params": {"temperature": 0.7, "max_tokens": 5}, "val_sampling_params": {"temperature": 0.0},
        "response_length": 9, "agent_loop_modules": ["json"], "my_option": {"a": 1}, "truncate": 1})
    assert record.sampling_params == SamplingParams(temperature=0.7, max_tokens=5)
    assert record.sampling_for(True) == SamplingParams(temperature=0.0, max_tokens=5)
    assert record.sampling_for(False) is record.sampling_params
    assert record.agent_loop_modules == ("json",)
    assert record.truncate is True
    assert record.loop_options == (("my_option", {"a": 1}),)
    assert record.loop_mapping() == {"prompt_length": None, "response_length": 9, "sanity_check": "strict",
                                     "my_option": {"a": 1}}
    assert pickle.loads(pickle.dumps(record)) == record


def test_without_max_tokens_a_turn_may_use_the_whole_response_length():
    assert RolloutConfig.from_mapping({"response_length": 40}).sampling_params.max_tokens == 40
    assert RolloutConfig.from_mapping({}).sampling_params == SamplingParams()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("sample_timeout_s", -1, "sample_timeout_s must be a positive number of seconds or None, got -1"),
    ("max_concurrent_samples", 0, "max_concurrent_samples must be a positive integer or None, got 0"),
    ("turns_per_loop_iteration", True, "turns_per_loop_iteration must be a positive integer or None, got True"),
    ("sampling_seed", "7", "sampling_seed must be an integer or None, got '7'"),
    ("hold_full_gc", "false", "hold_full_gc must be true or false, got 'false'"),
    ("response_length", 0, "response_length must be a positive integer or None, got 0"),
    ("sanity_check", "loose", "sanity_check must be one of"),
    ("pad_token_id", -1, "pad_token_id must be a token id"),
    ("reward_fn", "compute_score", "reward_fn must be an async callable"),
    ("sampling_params", {"temperature": 1.0}, "sampling_params must be a SamplingParams; build the record with "
                                             "RolloutConfig.from_mapping"),
])
def test_a_bad_value_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RolloutConfig(**{field: value})


def test_a_section_becomes_the_loops_config_built_once():
    record = RolloutConfig.from_mapping({"response_length": 12, "agent_loop_configs": {
        "settings_test_greeter": {"greeting": "hello"}, TEST_CHAT_AGENT: {"greeting": "mine"}}})
    built = dict(record.agent_loop_configs)
    assert built["settings_test_greeter"] == GreetConfig(greeting="hello", response_length=12)
    assert built[TEST_CHAT_AGENT] == (("greeting", "mine"),)  # a loop without a config class: its pairs
    assert record.loop_config("settings_test_greeter", GreeterLoop) is built["settings_test_greeter"]
    chat = record.loop_config(TEST_CHAT_AGENT, get_agent_loop_class(TEST_CHAT_AGENT))
    assert chat["greeting"] == "mine"
    assert chat["response_length"] == 12
    # A loop with no entry gets its config class read from the record's loop mapping.
    assert RolloutConfig(response_length=3).loop_config("settings_test_greeter", GreeterLoop) == GreetConfig(
        response_length=3)
    assert pickle.loads(pickle.dumps(record)) == record


def test_an_unknown_key_of_a_typed_loops_section_is_an_error_naming_the_closest():
    with pytest.raises(ValueError, match=r"settings_test_greeter config has unknown keys 'greting' "
                                         r"\(did you mean 'greeting'\?\)"):
        RolloutConfig().with_loop_configs({"settings_test_greeter": {"greting": "x"}})


def test_the_loop_holds_its_typed_config_as_config_and_nothing_else():
    config = GreetConfig(greeting="yo")
    assert GreeterLoop(None, None, config).config is config
    loop = GreeterLoop(None, None, {"greeting": "hey", "other": 1})
    assert loop.config == GreetConfig(greeting="hey")
    # One attribute for the loop's options: no second name that a subclass could replace alone.
    assert not hasattr(loop, "settings")
