"""The shared config of the tool loops (``ToolLoopConfig``): what each field accepts comes from
its own declaration, unknown keys of a user's section are named with the closest valid one, and
what the loops work out per tokenizer is cached without keeping the tokenizer alive."""

from __future__ import annotations

import gc
import subprocess
import sys
import typing
import weakref
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import pytest

from agentloop_core import DEFAULT_RESPONSE_LENGTH
from agentloop_core.parsers import DEFAULT_TOOL_PARSER
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools import per_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.loop_config import (
    ToolAgentConfig,
    ToolLoopConfig,
    check_loop_config_keys,
    loop_config_choices,
    loop_setting,
)
from agentloop_tools.per_tokenizer import check_template_renders_tools, stop_token_ids


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def test_choices_are_the_literal_types_of_the_fields():
    hints = typing.get_type_hints(ToolAgentConfig)
    choices = loop_config_choices(ToolAgentConfig)
    assert choices == {name: typing.get_args(hints[name]) for name in
                       ("tool_response_truncate_side", "tool_reward", "sanity_check", "delta_strategy")}
    for name, allowed in choices.items():
        with pytest.raises(ValueError, match=rf"tool_agent config {name} must be one of \({allowed[0]!r}"):
            ToolAgentConfig.from_mapping({name: "nope"})


def test_a_subclass_field_is_checked_from_its_declaration_alone():
    @dataclass(frozen=True)
    class MyLoopConfig(ToolLoopConfig):
        LOOP_NAME: ClassVar[str] = "my_loop"

        mode: Literal["fast", "exact"] = "exact"
        window: int | None = loop_setting(None, positive=True)

    assert MyLoopConfig.from_mapping({"mode": "fast", "window": None, "other_loop_key": 1}).mode == "fast"
    with pytest.raises(ValueError, match=r"my_loop config mode must be one of \('fast', 'exact'\), got 'slow'"):
        MyLoopConfig.from_mapping({"mode": "slow"})
    with pytest.raises(ValueError, match="my_loop config window must be a positive integer or None, got 0"):
        MyLoopConfig.from_mapping({"window": 0})
    with pytest.raises(ValueError, match="my_loop config response_length must be a positive integer, got 0"):
        MyLoopConfig.from_mapping({"response_length": 0})


def test_none_keeps_the_default_unless_the_type_admits_none():
    cfg = ToolAgentConfig.from_mapping({"response_length": None, "tool_timeout_s": None, "max_user_turns": None,
                                        "tool_parser": None})
    assert (cfg.response_length, cfg.tool_timeout_s, cfg.max_user_turns, cfg.tool_parser) == (
        DEFAULT_RESPONSE_LENGTH, None, None, DEFAULT_TOOL_PARSER)


@pytest.mark.parametrize(("config", "message"), [
    ({"max_user_turns": 0}, "max_user_turns must be a positive integer or None, got 0"),
    ({"max_parallel_calls": True}, "max_parallel_calls must be a positive integer, got True"),
    ({"prompt_length": 2.5}, "prompt_length must be a positive integer or None, got 2.5"),
    ({"tool_timeout_s": 0}, "tool_timeout_s must be a positive number or None, got 0"),
    ({"tool_timeout_s": float("nan")}, "tool_timeout_s must be a positive number or None, got nan"),
    ({"apply_chat_template_kwargs": ["enable_thinking"]}, "apply_chat_template_kwargs must be a mapping, got list"),
])
def test_bad_values_are_named_with_what_is_accepted(config, message):
    with pytest.raises(ValueError, match=f"tool_agent config {message}"):
        ToolAgentConfig.from_mapping(config)


def test_settings_built_directly_are_checked_too():
    assert ToolAgentConfig(tool_timeout_s=0.5).tool_timeout_s == 0.5
    with pytest.raises(ValueError, match="tool_agent config response_length must be a positive integer"):
        ToolAgentConfig(response_length=0)


def test_tool_agent_declares_only_its_own_fields():
    shared = {f.name for f in fields(ToolLoopConfig)}
    own = {f.name for f in fields(ToolAgentConfig)} - shared
    assert own == {"max_user_turns", "interaction", "interaction_config_path", "scoring_timeout_s"}
    assert set(ToolAgentConfig.__annotations__) == {"LOOP_NAME", *own}


def test_a_mapping_field_is_kept_as_pairs_and_the_config_pickles():
    import pickle

    cfg = ToolAgentConfig.from_mapping({"apply_chat_template_kwargs": {"enable_thinking": False}})
    assert cfg.apply_chat_template_kwargs == (("enable_thinking", False),)
    assert dict(cfg.apply_chat_template_kwargs) == {"enable_thinking": False}
    assert pickle.loads(pickle.dumps(cfg)) == cfg


@pytest.mark.parametrize(("typo", "closest"), [("max_assistant_turn", "max_assistant_turns"),
                                               ("delta_stratgy", "delta_strategy"),
                                               ("max_user_turn", "max_user_turns"),
                                               ("interaction_config", "interaction_config_path")])
def test_a_typo_in_a_tool_agent_section_names_the_closest_key(typo, closest):
    with pytest.raises(ValueError, match=rf"tool_agent config has unknown keys '{typo}' \(did you mean '{closest}'\?\)"):
        check_loop_config_keys("tool_agent", ToolAgentLoop.config_class, ["response_length", typo])


def test_the_0_4_aliases_are_gone():
    """0.5.0 dropped the rename hooks and re-exports (CHANGELOG.md): each name has one home."""
    from agentloop_tools import agent_loop, loop_config

    for module in (agent_loop, loop_config):
        assert not hasattr(module, "LOOP_CONFIG_CHOICES")
        assert not hasattr(module, "ToolLoopSettings")
    assert agent_loop.__all__ == ["AgentState", "ToolAgentLoop"]


# --- per-tokenizer caches ----------------------------------------------------------------------

class CountingTokenizer:
    """Delegates to the tiny tokenizer and counts ``get_vocab`` calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.vocab_calls = 0

    def get_vocab(self) -> dict[str, int]:
        self.vocab_calls += 1
        return self._inner.get_vocab()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SlottedTokenizer:
    """A tokenizer that cannot be weakly referenced."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def get_vocab(self) -> dict[str, int]:
        self.calls += 1
        return {"<|im_end|>": 7}


def test_stop_token_ids_are_worked_out_once_per_tokenizer(tokenizer):
    counting = CountingTokenizer(tokenizer)
    loops = [ToolAgentLoop(ScriptedServer(lambda *a: [1]), counting, {}) for _ in range(5)]
    assert counting.vocab_calls == 1
    assert all(loop.stop_token_ids == loops[0].stop_token_ids for loop in loops)
    assert stop_token_ids(counting, ("<|im_end|>", "not-a-token")) == (tokenizer.get_vocab()["<|im_end|>"],)
    assert counting.vocab_calls == 2  # another token tuple is another entry


def test_the_caches_do_not_keep_a_tokenizer_alive(tokenizer):
    counting = CountingTokenizer(tokenizer)
    stop_token_ids(counting, ("<|im_end|>",))
    assert counting in per_tokenizer._STOP_TOKEN_IDS
    alive = weakref.ref(counting)
    del counting
    gc.collect()
    assert alive() is None  # its entry went with it


def test_a_tokenizer_without_weak_references_is_not_cached():
    slotted = SlottedTokenizer()
    assert stop_token_ids(slotted, ("<|im_end|>", "x")) == (7,)
    assert stop_token_ids(slotted, ("<|im_end|>", "x")) == (7,)
    assert slotted.calls == 2


PLAIN_CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""ChatML that never reads ``tools`` (SmolLM2's template, without its default system prompt)."""

CALC_SCHEMA = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.",
                                                 "parameters": {"type": "object", "properties": {}}}}]


def test_the_template_check_runs_once_per_processor_and_template_and_forgets_freed_ones():
    from agentloop_core.testing import CountingProcessor
    from agentloop_core.tokenization import ChatRenderer, resolve_chat_template, tool_support

    processor = CountingProcessor(load_tiny_tokenizer())
    renderer = ChatRenderer(processor, tools=CALC_SCHEMA)
    before = processor.rendered
    check_template_renders_tools(renderer, ["calc"])
    check_template_renders_tools(renderer, ["calc"])
    assert processor.rendered - before == 2  # one check: with and without tools
    plain = ChatRenderer(processor, tools=CALC_SCHEMA, chat_template=PLAIN_CHATML)
    with pytest.raises(ValueError, match=r"tool_agent has tools \['calc'\] but the chat template ignores tools=") as err:
        check_template_renders_tools(plain, ["calc"])
    assert "model.custom_chat_template=chatml-hermes" in str(err.value)
    assert "ChatRenderer(chat_template=...)" in str(err.value)
    assert processor in tool_support._ANSWERS
    alive = weakref.ref(processor)
    del processor, renderer, plain, err  # the error's traceback holds the processor too
    gc.collect()
    assert alive() is None  # its entry went with it
    # A new processor is checked afresh, whatever address it gets; the built-in template fixes it.
    fresh = CountingProcessor(load_tiny_tokenizer())
    with pytest.raises(ValueError, match="ignores tools="):
        check_template_renders_tools(ChatRenderer(fresh, tools=CALC_SCHEMA, chat_template=PLAIN_CHATML), ["calc"])
    fixed = ChatRenderer(fresh, tools=CALC_SCHEMA, chat_template=resolve_chat_template("chatml-hermes"))
    check_template_renders_tools(fixed, ["calc"])


def test_importing_the_tools_package_warns_nothing():
    code = "import agentloop_tools, agentloop_tools.agent_loop, agentloop_tools.loop_config; from agentloop_tools import *"
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
