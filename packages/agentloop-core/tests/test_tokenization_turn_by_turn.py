"""The turn-by-turn sanity check (an unchanged engine-view trajectory, deltas rendered over the
history) gives the verdicts of the full re-encode, and whatever it cannot prove takes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_core.tokenization import ChatRenderer, Trajectory

SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")

# Qwen3-like: reasoning stripped from assistant turns a later user turn follows.
STRIPPING = (
    "{%- for m in messages %}{%- set content = m.content or '' %}"
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The generation prompt ends inside a word the engine completes: a merge across the boundary.
MID_WORD = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\nap' }}{%- endif %}"
)


FULL_CHECK = Trajectory._full_check
"""The full re-encode, unspied: the reference the turn-by-turn verdicts are compared with."""


@pytest.fixture
def full_checks(monkeypatch) -> list[str]:
    """The modes the full re-encode ran in (empty: every check went turn by turn)."""
    calls: list[str] = []
    monkeypatch.setattr(Trajectory, "_full_check", lambda self, mode: calls.append(mode) or FULL_CHECK(self, mode))
    return calls


def _turn(renderer: ChatRenderer, text: str, *, ended: bool = True) -> TokenOutput:
    assert renderer.eos_token_id is not None
    ids = renderer.encode(text) + ([renderer.eos_token_id] if ended else [])
    return TokenOutput(ids, [-0.5] * len(ids), stop_reason="stop" if ended else "length")


def _build(renderer: ChatRenderer, turns: list[tuple[str, list[dict] | None]], *, ended: bool = True) -> Trajectory:
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}], sanity_check="strict")
    for text, following in turns:
        traj.append_generated(_turn(renderer, text, ended=ended))
        if following:
            traj.append_messages(following)
    return traj


TOOL = [{"role": "tool", "content": "42"}]
USER = [{"role": "user", "content": "Sure?"}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>'
SCENARIOS = {
    "tool_calls": (None, [(CALL, TOOL), ("It is 42.", None)], True),
    "user_turns": (None, [("42.", USER), ("Yes, 42.", USER), ("Sure.", None)], True),
    "cut_by_max_tokens": (None, [("Forty", USER), ("42", None)], False),
    "reasoning_stripped_later": (STRIPPING, [("<think>\nhm\n</think>\n\n42", USER), ("Yes.", None)], True),
    "merge_at_the_generation_prompt": (MID_WORD, [("ples: 42", USER), ("ples.", None)], True),
}


def _renderer(template: str | None, **kwargs) -> ChatRenderer:
    return ChatRenderer(load_tiny_tokenizer(), chat_template=template, **kwargs)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_turn_by_turn_gives_the_full_reencode_verdict(scenario, full_checks):
    template, turns, ended = SCENARIOS[scenario]
    traj = _build(_renderer(template), turns, ended=ended)
    for mode in ("strict", "ignore_strippable"):
        report = traj.sanity_check(mode)
        assert not full_checks, f"{scenario} took the full re-encode"
        assert report.ok, report.describe()
        assert report == FULL_CHECK(traj, mode)


def test_a_merge_across_the_generation_prompt_is_noncanonical_turn_by_turn(full_checks):
    renderer = _renderer(MID_WORD)
    assert renderer.encode("ap") + renderer.encode("ples") != renderer.encode("apples")
    traj = _build(renderer, [("ples.", None)])
    report = traj.sanity_check("strict")
    assert not full_checks
    assert report.ok, report.describe()
    assert report.canonical is False
    assert traj.to_output().metrics["tokenization_noncanonical"] == 1


@pytest.mark.parametrize("edit", ["tool_result_edited", "glue_dropped", "tool_token_changed", "calls_edited"])
def test_an_edit_after_appending_takes_the_full_reencode_and_fails(edit, full_checks):
    renderer = _renderer(None)
    traj = _build(renderer, [(CALL, None)])
    traj.attach_tool_calls([{"id": "c0", "type": "function", "function": {"name": "calc", "arguments": "{}"}}])
    traj.append_messages(TOOL)
    traj.append_generated(_turn(renderer, "It is 42."))
    traj.sanity_check("strict")
    assert not full_checks
    at = traj.response_mask.index(0)  # the "\n" glue after the call's <|im_end|>
    if edit == "tool_result_edited":
        traj.messages[2]["content"] = "41"
    elif edit == "glue_dropped":
        for seq in (traj.response_ids, traj.response_mask, traj.response_logprobs):
            assert seq is not None
            del seq[at]
    elif edit == "tool_token_changed":
        traj.response_ids[at + 3] = traj.response_ids[at + 3] + 1
    else:  # a template that reads the calls would render the delta differently; this one does not
        traj._tool_calls[1][0]["function"]["arguments"] = '{"x": "1"}'
    report = traj.sanity_check("strict")
    assert full_checks == ["strict"]
    assert report.ok is (edit == "calls_edited"), report.describe()


def test_a_template_rewriting_an_earlier_turn_is_caught_at_that_turn(full_checks):
    turns = [("42.", USER), ("<think>\nhm\n</think>\n\nYes.", USER), ("Sure.", None)]
    engine = _build(_renderer(STRIPPING), turns)
    # The engine view compares what the engine saw: the strip comes after, so it passes turn by turn.
    assert engine.sanity_check("strict").ok
    assert not full_checks
    inference = _build(_renderer(STRIPPING, use_inference_chat_template=True), turns)
    report = inference.sanity_check("strict")
    assert not report.ok
    # The first difference is where the second turn's reasoning was stripped.
    second = len(inference.prompt_ids) + [i for i, m in enumerate(inference.response_mask)
                                          if m and (i == 0 or not inference.response_mask[i - 1])][1]
    assert report.first_mismatch == second, report.describe()
    assert "<think>" in report.actual_text
    assert "<think>" not in report.expected_text


@pytest.mark.skipif(not SHARED_TEMPLATES.is_dir(), reason="needs ../shared/data/chat_templates (absent in a fresh clone)")
@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "openai-gpt-oss-120b", "mistralai-Mistral-Nemo-Instruct-2407"])
def test_real_templates_check_turn_by_turn_as_the_full_reencode(name, full_checks):
    renderer = ChatRenderer(tiny_tokenizer_for_template(SHARED_TEMPLATES / f"{name}.jinja"))
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}], sanity_check="strict")
    for text, follow_up in (("It is 42.", "Sure?"), ("Yes, 42.", "Thanks."), ("You are welcome.", None)):
        traj.append_generated(_turn(renderer, text))
        if follow_up:
            traj.append_messages([{"role": "user", "content": follow_up}])
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()
    assert not full_checks
    assert report == FULL_CHECK(traj, "strict")
