"""The engine-view sanity check reuses the prompt and history-delta renders its trajectory
already made, but only for exactly the same inputs: a message, attached call or template
changed since is rendered again, so the check still reports ids that do not follow from the
messages."""

from __future__ import annotations

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import COUNTING_TOOL_RESULTS_TEMPLATE, load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, TokenizationMismatchError, Trajectory
from agentloop_core.tokenization import renderer as renderer_module

TOOLS = [{
    "type": "function",
    "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                 "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}},
}]


class _Counting:
    """Wraps a renderer's ``render_text`` to record how many messages each render got."""

    def __init__(self, renderer: ChatRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lengths: list[int] = []
        original = renderer.render_text

        def counting(messages, **kwargs):
            self.lengths.append(len(messages))
            return original(messages, **kwargs)

        monkeypatch.setattr(renderer, "render_text", counting)


def _tool_turns(renderer: ChatRenderer, turns: int, **kwargs) -> Trajectory:
    traj = Trajectory(renderer, [{"role": "user", "content": "Add up the numbers."}], **kwargs)
    for k in range(turns):
        generated = renderer.encode(f"Calling the tool, turn {k}.") + [renderer.eos_token_id]
        traj.append_generated(TokenOutput(generated, [-0.1] * len(generated)))
        traj.attach_tool_calls([{"id": f"call_{k}", "type": "function",
                                 "function": {"name": "calc", "arguments": '{"x": "1"}'}}])
        traj.append_messages([{"role": "tool", "name": "calc", "tool_call_id": f"call_{k}", "content": str(k * 7)}])
    return traj


def test_a_checked_trajectory_renders_each_delta_once_and_the_check_renders_nothing(monkeypatch):
    tok = load_tiny_tokenizer()
    exact = _tool_turns(ChatRenderer(tok, tools=TOOLS, delta_strategy="history"), 5, sanity_check="disable")
    renderer = ChatRenderer(tok, tools=TOOLS)
    monkeypatch.setattr(renderer._frames, "off", "this test counts history renders")  # test_framed_delta: frames
    counted = _Counting(renderer, monkeypatch)
    traj = _tool_turns(renderer, 5, sanity_check="strict")
    assert counted.lengths == [1, 3, 5, 7, 9, 11]  # the prompt, then each delta over the whole history
    assert traj.context_ids == exact.context_ids
    assert traj.response_mask == exact.response_mask
    out = traj.to_output(sanity_check="strict")
    assert len(counted.lengths) == 6  # the check reused every render
    assert out.metrics == {}


def test_an_unchecked_trajectory_keeps_the_short_delta(monkeypatch):
    monkeypatch.setattr(renderer_module, "_SHORT_DELTA_VERDICTS", {})
    tok = load_tiny_tokenizer()
    monkeypatch.setattr(ChatRenderer(tok, tools=TOOLS)._frames, "off", "this test counts short renders")  # no frames
    _tool_turns(ChatRenderer(tok, tools=TOOLS), 4)  # agrees VERIFY_DELTAS times: short from now on
    renderer = ChatRenderer(tok, tools=TOOLS)
    counted = _Counting(renderer, monkeypatch)
    traj = _tool_turns(renderer, 4, sanity_check="disable")
    assert max(counted.lengths[1:]) <= 3
    assert traj.sanity_check("strict").ok  # renders the history deltas it never made
    assert max(counted.lengths) > 3


def test_a_template_that_reads_further_back_gets_exact_deltas_when_checked(monkeypatch):
    monkeypatch.setattr(renderer_module, "_SHORT_DELTA_VERDICTS", {})
    tok = load_tiny_tokenizer()
    traj = _tool_turns(ChatRenderer(tok, chat_template=COUNTING_TOOL_RESULTS_TEMPLATE), 6, sanity_check="strict")
    assert "#6 35" in traj.renderer.decode(traj.context_ids)
    assert traj.sanity_check("strict").ok
    assert renderer_module._SHORT_DELTA_VERDICTS == {}  # never needed the short render


@pytest.mark.parametrize("change", ["tool_content", "prompt", "template"])
def test_inputs_changed_after_rendering_are_rendered_again_and_reported(change, monkeypatch):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, tools=TOOLS)
    traj = _tool_turns(renderer, 3, sanity_check="strict")
    if change == "tool_content":
        traj.messages[2]["content"] = "999"
    elif change == "prompt":
        traj.messages[0]["content"] = "Add up other numbers."
    else:
        monkeypatch.setattr(renderer, "chat_template", COUNTING_TOOL_RESULTS_TEMPLATE)
    counted = _Counting(renderer, monkeypatch)
    report = traj.sanity_check("strict")
    assert counted.lengths, "the check reused a render whose inputs changed"
    assert not report.ok, report.describe()
    with pytest.raises(TokenizationMismatchError):
        traj.to_output(sanity_check="strict")


def test_a_call_attached_after_its_delta_was_rendered_is_rendered_again(monkeypatch):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, tools=TOOLS)
    traj = _tool_turns(renderer, 2, sanity_check="strict")
    traj.attach_tool_calls([{"id": "call_other", "type": "function",
                             "function": {"name": "other", "arguments": "{}"}}])
    counted = _Counting(renderer, monkeypatch)
    traj.sanity_check("strict")
    assert counted.lengths == [5]  # only the delta after the turn whose calls changed


def test_inputs_that_are_not_json_are_rendered_again(monkeypatch):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, tools=TOOLS)
    traj = _tool_turns(renderer, 2, sanity_check="strict")
    traj.messages[0]["metadata"] = object()  # the template ignores it; JSON cannot hold it
    counted = _Counting(renderer, monkeypatch)
    assert traj.sanity_check("strict").ok
    assert counted.lengths == [1, 3, 5]


def test_an_unknown_sanity_mode_is_refused_at_construction():
    renderer = ChatRenderer(load_tiny_tokenizer())
    with pytest.raises(ValueError, match="sanity_check must be one of"):
        Trajectory(renderer, [{"role": "user", "content": "Hi."}], sanity_check="strcit")
