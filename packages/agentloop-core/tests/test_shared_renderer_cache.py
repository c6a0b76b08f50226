"""One renderer per tokenizer and settings (``shared_renderer``): the same ids as a renderer of
one's own, a new renderer wherever a fresh one would differ, and snapshots that are the JSON
they stand for."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import weakref
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_core.tokenization import ChatRenderer, ChatTemplateError, Trajectory
from agentloop_core.tokenization import shared_renderer as shared_renderer_module
from agentloop_core.tokenization.incremental import _to_json, snapshot
from agentloop_core.tokenization.shared_renderer import shared_renderer

SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Arithmetic.",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>'


def _turn(renderer: ChatRenderer, text: str) -> TokenOutput:
    assert renderer.eos_token_id is not None
    ids = [*renderer.encode(text), renderer.eos_token_id]
    return TokenOutput(ids, [-0.5] * len(ids), stop_reason="stop")


def _tool_trajectory(renderer: ChatRenderer, question: str) -> Trajectory:
    """Two tool calls with their results, then an answer, checked strictly."""
    traj = Trajectory(renderer, [{"role": "user", "content": question}], sanity_check="strict")
    for k in range(2):
        traj.append_generated(_turn(renderer, CALL))
        traj.attach_tool_calls([{"id": f"call0000{k}", "type": "function",
                                 "function": {"name": "calc", "arguments": '{"x": "6*7"}'}}])
        traj.append_messages([{"role": "tool", "name": "calc", "tool_call_id": f"call0000{k}", "content": f"{42 + k}"}])
    traj.append_generated(_turn(renderer, "It is 42."))
    return traj


def _templates() -> list:
    params = [pytest.param(None, id="tiny-chatml")]
    if SHARED_TEMPLATES.is_dir():
        params += [pytest.param(p, id=p.stem) for p in sorted(SHARED_TEMPLATES.glob("*.jinja"))]
    return params


@pytest.mark.parametrize("template", _templates())
def test_trajectories_on_a_shared_renderer_get_the_ids_of_their_own_renderer(template):
    tok = load_tiny_tokenizer() if template is None else tiny_tokenizer_for_template(template)
    shared = shared_renderer(tok, tools=TOOLS)
    for i in range(3):  # the shared renderer has served other trajectories before
        _tool_trajectory(shared, f"Warm-up {i}?").to_output()
    assert shared_renderer(tok, tools=TOOLS) is shared
    for question in ("What is 6*7?", "And 7*6, twice?"):
        mine, ours = _tool_trajectory(ChatRenderer(tok, tools=TOOLS), question), _tool_trajectory(shared, question)
        assert ours.context_ids == mine.context_ids
        assert ours.response_mask == mine.response_mask
        assert ours.to_output().response_ids == mine.to_output().response_ids


@pytest.mark.parametrize("change", [
    {"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "other"}}]},
    {"apply_chat_template_kwargs": {"enable_thinking": False}},
    {"delta_strategy": "history"},
    {"use_inference_chat_template": True},
    {"allow_special_tokens_in_content": True},
    {"chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"},
])
def test_other_settings_get_another_renderer(change):
    tok = load_tiny_tokenizer()
    first = shared_renderer(tok, tools=TOOLS)
    other = shared_renderer(tok, **{"tools": TOOLS, **change})
    assert other is not first
    for name, value in change.items():
        assert getattr(other, name) == value


def test_a_tokenizer_changed_in_place_gets_a_new_renderer():
    tok = load_tiny_tokenizer()
    first = shared_renderer(tok)
    tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}<|im_end|>\n{% endfor %}" \
                        "{% if add_generation_prompt %}[assistant] {% endif %}"
    second = shared_renderer(tok)
    assert second is not first
    assert second.render_text([{"role": "user", "content": "Hi."}], add_generation_prompt=True) == \
        "[user] Hi.<|im_end|>\n[assistant] "
    tok.add_special_tokens({"additional_special_tokens": ["<|agentloop_new|>"]})
    third = shared_renderer(tok)
    assert third is not second
    assert "<|agentloop_new|>" in third.special_tokens


def test_settings_that_are_not_json_build_a_renderer_each_time():
    tok = load_tiny_tokenizer()
    odd = {"when": object()}
    assert shared_renderer(tok, apply_chat_template_kwargs=odd) is not shared_renderer(tok, apply_chat_template_kwargs=odd)


def test_a_failing_template_fails_at_every_call():
    tok = load_tiny_tokenizer()
    tok.chat_template = "{{ raise_exception('this model takes no chat') }}"
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="this model takes no chat"):
            shared_renderer(tok)


class _Processor:
    """A processor around the tiny tokenizer (which its loader keeps alive on its own)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def test_the_cache_keeps_neither_the_tokenizer_nor_the_renderer_alive():
    processor = _Processor(load_tiny_tokenizer())
    renderer = shared_renderer(processor, tools=TOOLS)
    assert shared_renderer(processor, tools=TOOLS) is renderer
    processor_ref, renderer_ref = weakref.ref(processor), weakref.ref(renderer)
    entries = len(shared_renderer_module._SHARED)
    del processor, renderer
    gc.collect()
    assert processor_ref() is None
    assert renderer_ref() is None
    assert len(shared_renderer_module._SHARED) == entries - 1


def test_changing_renderer_tools_after_construction_reaches_no_render_and_no_check():
    """The renderer renders the schemas it was built with; the trajectory's check (and its
    reuse of the renders) reads those, not ``renderer.tools`` as changed later."""
    renderer = ChatRenderer(load_tiny_tokenizer(), tools=TOOLS, allow_special_tokens_in_content=True)
    before = renderer.render_text([{"role": "user", "content": "Hi."}], add_generation_prompt=True)
    traj = _tool_trajectory(renderer, "What is 6*7?")
    assert renderer.tools is not None
    renderer.tools[0]["function"]["name"] = "changed"
    assert renderer.render_text([{"role": "user", "content": "Hi."}], add_generation_prompt=True) == before
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()
    assert report.canonical


_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
_nested = _leaves | st.lists(_leaves, max_size=4) | st.dictionaries(st.text(max_size=5), _leaves, max_size=4)
json_values = _nested | st.lists(_nested, max_size=3) | st.dictionaries(st.text(max_size=5), _nested, max_size=3)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_snapshot_json_is_json_dumps(value):
    assert _to_json(value) == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("value", [{(1, 2): 3}, object(), {"a": {1, 2}}])
def test_snapshot_json_refuses_what_json_dumps_refuses(value):
    with pytest.raises(TypeError):
        json.dumps(value, ensure_ascii=False)
    with pytest.raises(TypeError):
        _to_json(value)
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular reference"):
        _to_json(cycle)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_snapshot_is_the_digest_of_json_dumps(value):
    expected = hashlib.blake2b(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"), digest_size=16)
    assert snapshot(value) == expected.digest()


def test_a_snapshot_of_what_json_cannot_hold_is_none():
    """Nothing can be compared by it, so the caller renders again; a cycle or nesting deeper
    than the recursion limit is not an error in the middle of a rollout."""
    cycle: list = []
    cycle.append(cycle)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for value in (cycle, deep, {"a": object()}, {(1, 2): 3}):
        assert snapshot(value) is None
