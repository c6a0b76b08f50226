"""The ``multi_turn`` section is derived from the tool loops' config (#47): each tool-loop key is
declared once, in ``ToolAgentConfig``, and reaches the loops under the same name."""

from __future__ import annotations

import dataclasses

import pytest

from agentloop_core import DEFAULT_RESPONSE_LENGTH
from agentloop_tools.loop_config import ToolAgentConfig
from agentloop_trainer.config import DataSection, MultiTurnSection, load_config
from agentloop_trainer.rollout.multi_turn import MULTI_TURN_LOOP_KEYS
from agentloop_trainer.stages.rollout_setup import rollout_config

TRAINER_KEYS = {"enable", "max_tokens_per_turn"}
"""The section's keys that are the trainer's own (not the loops')."""
TRAINER_CHOICES = {"max_assistant_turns": 3}
"""Tool-loop keys whose default the trainer chooses itself, with that choice."""


def test_the_section_has_exactly_the_loops_keys_with_the_loops_defaults():
    section = {f.name: f for f in dataclasses.fields(MultiTurnSection)}
    loop = {f.name: f for f in dataclasses.fields(ToolAgentConfig)}
    assert set(section) == TRAINER_KEYS | set(MULTI_TURN_LOOP_KEYS)
    assert set(MULTI_TURN_LOOP_KEYS) <= set(loop)
    differ = {name: (section[name].default, loop[name].default) for name in MULTI_TURN_LOOP_KEYS
              if section[name].default != TRAINER_CHOICES.get(name, loop[name].default)}
    assert differ == {}


def test_the_rollout_passes_every_section_key_to_the_loops_under_its_name():
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.tool_parser=llama3_json",
                       "actor_rollout_ref.rollout.multi_turn.max_tool_response_tokens=40",
                       "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left"])
    options = dict(rollout_config(cfg).loop_options)
    assert set(MULTI_TURN_LOOP_KEYS) <= set(options)
    assert (options["tool_parser"], options["max_tool_response_tokens"], options["tool_response_truncate_side"]) \
        == ("llama3_json", 40, "left")
    assert options["tool_reward"] in ("sum", "none")
    built = dict(rollout_config(cfg).agent_loop_configs)["tool_agent"]
    assert (built.tool_parser, built.max_tool_response_tokens, built.max_assistant_turns) == ("llama3_json", 40, 3)


@pytest.mark.parametrize(("override", "message"), [
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=many", "max_parallel_calls"),
    ("actor_rollout_ref.rollout.multi_turn.tool_parsr=hermes", "did you mean"),
])
def test_a_bad_tool_loop_key_is_still_an_error_naming_it(override, message):
    with pytest.raises(Exception, match=message):
        load_config([override])


def test_the_response_budget_default_is_the_one_constant():
    assert DataSection().max_response_length == DEFAULT_RESPONSE_LENGTH
    assert ToolAgentConfig().response_length == DEFAULT_RESPONSE_LENGTH
