"""``react_agent``'s config: the keys every tool loop reads come from ``ToolLoopConfig`` (one
declaration for ``tool_agent`` and ``react_agent``, so they cannot drift apart), the graph keys are
its own, and a typo in a user's section names the closest key."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest

from agentloop_core.testing import ScriptedServer
from agentloop_langgraph import ChatModel, ReactAgentConfig, ReactAgentLoop
from agentloop_langgraph.messages import HISTORY_REWRITE_CHOICES
from agentloop_tools.loop_config import (
    ToolAgentConfig,
    ToolLoopConfig,
    check_loop_config_keys,
    loop_config_choices,
)


def test_react_agent_extends_the_shared_settings_with_its_graph_keys_only():
    assert issubclass(ReactAgentConfig, ToolLoopConfig)
    assert issubclass(ToolAgentConfig, ToolLoopConfig)
    shared = {f.name for f in fields(ToolLoopConfig)}
    assert {f.name for f in fields(ReactAgentConfig)} - shared == {
        "graph_factory", "graph_factory_kwargs", "system_prompt", "recursion_limit", "on_history_rewrite"}
    # Declared in the class body: nothing shared is redeclared (and so cannot drift).
    assert not shared & set(ReactAgentConfig.__annotations__)


def test_choices_come_from_the_literal_types():
    choices = loop_config_choices(ReactAgentConfig)
    assert choices["on_history_rewrite"] == HISTORY_REWRITE_CHOICES
    assert choices["delta_strategy"] == typing.get_args(typing.get_type_hints(ToolLoopConfig)["delta_strategy"])
    assert {k: v for k, v in choices.items() if k != "on_history_rewrite"} == loop_config_choices(ToolAgentConfig)


@pytest.mark.parametrize(("config", "message"), [
    ({"graph_factory_kwargs": ["x"]}, "graph_factory_kwargs must be a mapping, got list"),
    ({"recursion_limit": 0}, "recursion_limit must be a positive integer, got 0"),
    ({"max_parallel_calls": 0}, "max_parallel_calls must be a positive integer, got 0"),
    ({"tool_timeout_s": -1}, "tool_timeout_s must be a positive number or None, got -1"),
])
def test_bad_values_name_the_loop_and_the_key(config, message):
    with pytest.raises(ValueError, match=f"react_agent config {message}"):
        ReactAgentConfig.from_mapping(config)


@pytest.mark.parametrize(("typo", "closest"), [("max_paralel_calls", "max_parallel_calls"),
                                               ("delta_stratgy", "delta_strategy"),
                                               ("recursion_limt", "recursion_limit"),
                                               ("on_history_rewrites", "on_history_rewrite")])
def test_a_typo_in_a_react_agent_section_names_the_closest_key(typo, closest):
    with pytest.raises(ValueError, match=rf"react_agent config has unknown keys '{typo}' \(did you mean '{closest}'\?\)"):
        check_loop_config_keys("react_agent", ReactAgentLoop.config_class, ["graph_factory", typo])


class CountingTokenizer:
    """Delegates to a tokenizer and counts ``get_vocab`` calls."""

    def __init__(self, inner):
        self._inner = inner
        self.vocab_calls = 0

    def get_vocab(self):
        self.vocab_calls += 1
        return self._inner.get_vocab()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_chat_models_of_one_tokenizer_share_its_stop_token_ids(tokenizer):
    counting = CountingTokenizer(tokenizer)
    models = [ChatModel(server=ScriptedServer(lambda *a: [1]), tokenizer=counting, sampling_params={},
                        request_id=f"r{i}") for i in range(4)]
    assert counting.vocab_calls == 1
    assert len({m._base_params.stop_token_ids for m in models}) == 1
