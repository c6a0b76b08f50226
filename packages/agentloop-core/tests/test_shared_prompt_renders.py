"""Prompt renders are shared across the trajectories of one renderer (GRPO rolls each prompt
out several times), keyed by the same digest of everything the render reads as a
trajectory's own renders; a preview and the append that follows it share one digest per new
message."""

from __future__ import annotations

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, Trajectory
from agentloop_core.tokenization import trajectory_check as check_module

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def _counting(renderer: ChatRenderer, monkeypatch: pytest.MonkeyPatch, name: str = "render_text") -> list[int]:
    """Record each call of ``renderer.<name>`` (its first argument's length)."""
    calls: list[int] = []
    original = getattr(renderer, name)

    def counting(messages, *args, **kwargs):
        calls.append(len(messages))
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(renderer, name, counting)
    return calls


def test_the_same_prompt_is_rendered_once_per_renderer(monkeypatch):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok)
    calls = _counting(renderer, monkeypatch)
    first = Trajectory(renderer, PROMPT, sanity_check="strict")
    second = Trajectory(renderer, [dict(m) for m in PROMPT], sanity_check="strict")
    assert calls == [1]
    assert second.prompt_ids == first.prompt_ids == renderer.render_prompt(PROMPT)
    Trajectory(renderer, [{"role": "user", "content": "What is 2 + 4?"}])  # another prompt renders
    assert len(calls) == 3  # (render_prompt above rendered once too)
    other = ChatRenderer(tok, apply_chat_template_kwargs={"unused": 1})
    other_calls = _counting(other, monkeypatch)
    Trajectory(other, PROMPT)  # another renderer has its own memory
    assert other_calls == [1]


def test_a_template_that_reads_the_clock_renders_every_prompt(monkeypatch):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template='{%- set today = strftime_now("%d %b %Y") %}' + tok.chat_template)
    calls = _counting(renderer, monkeypatch)
    Trajectory(renderer, PROMPT)
    Trajectory(renderer, PROMPT)
    assert calls == [1, 1]


def test_the_shared_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(check_module, "SHARED_PROMPT_RENDERS", 2)
    renderer = ChatRenderer(load_tiny_tokenizer())
    for k in range(5):
        Trajectory(renderer, [{"role": "user", "content": f"Question {k}"}])
        assert len(check_module._PROMPT_TEXTS[renderer]) <= 2
        assert len(check_module._PROMPT_IDS[renderer]) <= 2  # the prompts' ids too


def test_a_changed_template_misses_the_shared_memory(monkeypatch):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok)
    before = Trajectory(renderer, PROMPT).prompt_ids
    monkeypatch.setattr(renderer, "chat_template", "{{ 'SYSTEM ' }}" + tok.chat_template)
    after = Trajectory(renderer, PROMPT).prompt_ids
    assert after != before
    assert after == renderer.render_prompt(PROMPT)


@pytest.mark.parametrize(("extra", "renders"), [("json", 1), ("not_json", 2)])
def test_an_append_reuses_its_preview_only_for_json_messages(extra, renders, monkeypatch):
    """The preview is keyed by each new message's digest; a message that is not JSON has none,
    so the append renders its delta again rather than trust a text form of it."""
    renderer = ChatRenderer(load_tiny_tokenizer())
    traj = Trajectory(renderer, PROMPT, sanity_check="strict")
    assert renderer.eos_token_id is not None
    ids = [*renderer.encode("Calling."), renderer.eos_token_id]
    traj.append_generated(TokenOutput(ids, [-0.1] * len(ids)))
    calls = _counting(renderer, monkeypatch, "delta_text")
    message = {"role": "tool", "name": "calc", "tool_call_id": "c0", "content": "5",
               "metadata": 1 if extra == "json" else object()}
    preview = traj.preview_messages([message])
    appended = traj.append_messages([message])
    assert appended == preview
    assert len(calls) == renders


def test_the_same_prompt_text_holds_its_ids_once_and_encodes_them_once(monkeypatch):
    """A GRPO group's samples share their prompt's ids (one list, one encode), and a change to
    one trajectory never reaches another: a trajectory replaces its prompt ids, and the list
    (its output's too) refuses changes in place."""
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok)
    encodes = _counting(renderer, monkeypatch, "encode")
    first = Trajectory(renderer, PROMPT, sanity_check="strict")
    second = Trajectory(renderer, [dict(m) for m in PROMPT], sanity_check="strict")
    assert second.prompt_ids is first.prompt_ids
    assert encodes == [len(renderer.render_text(PROMPT, add_generation_prompt=True))]
    other = Trajectory(renderer, [{"role": "user", "content": "What is 2 + 4?"}])
    assert other.prompt_ids is not first.prompt_ids
    assert other.prompt_ids != first.prompt_ids
    shared = list(first.prompt_ids)
    # Before any generation, an appended message re-renders the prompt: a new list, not a change.
    first.append_messages([{"role": "user", "content": "And 3 + 4?"}])
    assert second.prompt_ids == shared
    assert first.prompt_ids != shared
    assert renderer.eos_token_id is not None
    ids = [*renderer.encode("5"), renderer.eos_token_id]
    second.append_generated(TokenOutput(ids, [-0.5] * len(ids)))
    out = second.to_output()
    assert out.prompt_ids == shared
    # The output shares the list too; it is read-only, so no holder can change another's.
    assert out.prompt_ids is second.prompt_ids
    with pytest.raises(TypeError, match=r"list\(output.prompt_ids\)"):
        out.prompt_ids.append(1)


def test_a_renderer_that_shares_no_renders_encodes_each_prompt_itself():
    """Where prompt renders are not shared (a template that reads the clock; a vision
    renderer, whose image expansion depends on the trajectory's limits), nor are their ids."""
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template='{%- set today = strftime_now("%d %b %Y") %}' + tok.chat_template)
    first, second = Trajectory(renderer, PROMPT), Trajectory(renderer, PROMPT)
    assert first.prompt_ids == second.prompt_ids
    assert first.prompt_ids is not second.prompt_ids

