"""The tokenization sanity check catches corrupted trajectories and tolerates what it should."""

from __future__ import annotations

import logging

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, TokenizationMismatchError, Trajectory
from agentloop_core.tokenization.framed_delta import TemplateFrames


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(load_tiny_tokenizer())


def _tool_trajectory(renderer: ChatRenderer) -> Trajectory:
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}])
    call = renderer.encode('<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>')
    traj.append_generated(TokenOutput(call + [renderer.eos_token_id], [-0.5] * (len(call) + 1)))
    traj.append_messages([{"role": "tool", "content": "42"}])
    answer = renderer.encode("It is 42.")
    traj.append_generated(TokenOutput(answer + [renderer.eos_token_id], [-0.1] * (len(answer) + 1)))
    return traj


def test_clean_trajectory_passes(renderer):
    traj = _tool_trajectory(renderer)
    report = traj.sanity_check("strict")
    assert report.ok
    assert report.canonical is True
    assert report.first_mismatch is None
    out = traj.to_output(reward_score=1.0, metrics={"x": 1}, extra_fields={"k": "v"})
    assert out.metrics == {"x": 1}
    assert out.extra_fields == {"k": "v"}
    assert out.reward_score == 1.0


def test_missing_glue_newline_fails_strict_and_passes_ignore_strippable(renderer, monkeypatch):
    # The verl bug: nothing appended between <|im_end|> and the next turn's <|im_start|>.
    cut = renderer._cut
    monkeypatch.setattr(renderer, "_cut", lambda *args: cut(*args).removeprefix("\n"))
    # Frames are shared by every renderer of a template: one an earlier test built would render
    # the delta without _cut. Fresh ones, for this trajectory only, are built from the cut.
    monkeypatch.setattr(renderer, "_frames", TemplateFrames())
    traj = _tool_trajectory(renderer)
    monkeypatch.undo()
    assert "<|im_end|><|im_start|>user" in renderer.decode(traj.context_ids)
    report = traj.sanity_check("strict")
    assert not report.ok
    assert report.first_mismatch is not None
    assert "<|im_end|>\n<|im_start|>" in report.expected_text
    assert "<|im_end|><|im_start|>" in report.actual_text
    with pytest.raises(TokenizationMismatchError, match="first mismatching token index"):
        traj.to_output(sanity_check="strict")
    lenient = traj.sanity_check("ignore_strippable")
    assert lenient.ok
    assert "whitespace" in lenient.reason
    out = traj.to_output(sanity_check="ignore_strippable")
    assert out.metrics["tokenization_mismatch_ignored"] == 1
    assert "tokenization_mismatch" not in out.metrics


def test_corrupted_tool_tokens_fail_both_modes_and_are_logged(renderer, caplog):
    traj = _tool_trajectory(renderer)
    forty_two = renderer.encode("42")
    at = next(
        i
        for i in range(len(traj.response_ids))
        if traj.response_mask[i] == 0 and traj.response_ids[i : i + len(forty_two)] == forty_two
    )
    traj.response_ids[at] = renderer.encode("7")[0]
    assert not traj.sanity_check("strict").ok
    report = traj.sanity_check("ignore_strippable")
    assert not report.ok
    assert report.first_mismatch == len(traj.prompt_ids) + at
    with caplog.at_level(logging.WARNING, logger="agentloop_core.tokenization.trajectory"):
        out = traj.to_output(sanity_check="ignore_strippable")
    assert out.metrics["tokenization_mismatch"] == 1
    assert "MISMATCH" in caplog.text
    assert "42" in caplog.text


def test_dropped_token_is_caught(renderer):
    traj = _tool_trajectory(renderer)
    newline_at = traj.response_mask.index(0)  # first mask-0 token: the "\n" glue
    for seq in (traj.response_ids, traj.response_mask, traj.response_logprobs):
        del seq[newline_at]
    assert not traj.sanity_check("strict").ok
    assert traj.sanity_check("ignore_strippable").ok  # only a newline is missing


def test_disable_skips_the_check(renderer):
    traj = _tool_trajectory(renderer)
    traj.response_ids[-3] = 5
    assert traj.sanity_check("disable").ok
    out = traj.to_output(sanity_check="disable")
    assert "tokenization_mismatch" not in out.metrics


def test_noncanonical_generation_passes_strict(renderer):
    # A model may sample "apples" letter by letter instead of as the merged tokens; those are
    # its tokens to train on, not a delta error.
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    ids = [t for ch in "apples" for t in renderer.encode(ch)] + [renderer.eos_token_id]
    assert ids[:-1] != renderer.encode("apples")
    traj.append_generated(TokenOutput(ids))
    traj.append_messages([{"role": "user", "content": "Bye."}])
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()
    assert report.canonical is False, report.describe()
    assert traj.to_output().metrics["tokenization_noncanonical"] == 1


def test_attached_tool_calls_change_no_id_and_the_inference_view_reports_them():
    traj = _tool_trajectory(renderer_for_view := ChatRenderer(load_tiny_tokenizer()))
    before = list(traj.context_ids)
    traj.messages[1]["tool_calls"] = [
        {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"x": "6*7"}}}
    ]
    # The engine view never renders a generated turn's text or calls: the ids are the engine's.
    assert traj.context_ids == before
    assert traj.sanity_check("strict").ok
    inference = Trajectory(ChatRenderer(load_tiny_tokenizer(), use_inference_chat_template=True), traj.messages[:1])
    for piece in _tool_trajectory(renderer_for_view).messages[1:]:
        if piece["role"] == "assistant":
            inference.append_generated(TokenOutput(renderer_for_view.encode(piece["content"])
                                                   + [renderer_for_view.eos_token_id]))
        else:
            inference.append_messages([piece])
    assert inference.sanity_check("strict").ok
    # An inference server sent the calls as well as the text renders the markup twice.
    inference.messages[1]["tool_calls"] = traj.messages[1]["tool_calls"]
    report = inference.sanity_check("ignore_strippable")
    assert not report.ok
    assert "inference view" in report.reason
