"""Tool loops built per sample share one chat renderer per tokenizer and settings
(:func:`agentloop_core.tokenization.shared_renderer.shared_renderer`), and their trajectories
get the ids a renderer of their own gives."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer
from agentloop_tools import agent_loop as agent_loop_module
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.builtin import calculator

SAMPLING = {"temperature": 0.0, "logprobs": True}
PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


def _server(tokenizer) -> ScriptedServer:
    turns = [_call("2 + 5"), _call("7 * 3"), _call("21 - 1"), "The answer is 20."]

    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True)


def _loop(tokenizer, **config: Any) -> ToolAgentLoop:
    return ToolAgentLoop(_server(tokenizer), tokenizer, {"tools": {"calculator": calculator}, "response_length": 2048,
                                                         **config})


def test_loops_with_the_same_settings_share_one_renderer():
    tok = load_tiny_tokenizer()
    first, second = _loop(tok), _loop(tok)
    assert second.renderer is first.renderer
    assert _loop(tok, apply_chat_template_kwargs={"enable_thinking": False}).renderer is not first.renderer
    assert _loop(tok, tools={}).renderer is not first.renderer


def test_a_template_that_ignores_tools_fails_every_loop_built():
    tok = load_tiny_tokenizer()
    tok.chat_template = PLAIN_CHATML
    for _ in range(2):
        with pytest.raises(ValueError, match="ignores tools="):
            _loop(tok)


async def test_trajectories_get_the_ids_of_a_renderer_of_their_own(monkeypatch):
    tok = load_tiny_tokenizer()
    prompts = [[{"role": "user", "content": f"What is (2 + 5) * 3 - {i}? Use the calculator."}] for i in range(3)]
    shared = [await _loop(tok).run(SAMPLING, raw_prompt=p, request_id=f"s{i}") for i, p in enumerate(prompts)]
    monkeypatch.setattr(agent_loop_module, "shared_renderer", lambda tokenizer, **kw: ChatRenderer(tokenizer, **kw))
    loops = [_loop(tok) for _ in prompts]
    assert loops[0].renderer is not loops[1].renderer
    own = [await loop.run(SAMPLING, raw_prompt=p, request_id=f"o{i}") for i, (loop, p) in enumerate(zip(loops, prompts, strict=True))]
    for ours, mine in zip(shared, own, strict=True):
        assert ours.metrics["tool_calls"] == 3
        assert (ours.prompt_ids, ours.response_ids, ours.response_mask, ours.response_logprobs) == \
            (mine.prompt_ids, mine.response_ids, mine.response_mask, mine.response_logprobs)
