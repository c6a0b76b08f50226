"""Shipped tasks a policy could game instead of solving (hostile-input issue #45, class 8).

The model is the adversary: a scripted engine plays a policy that searches for the answer
through an oracle (the GSM8K answer checker, the GSM8K interaction) or hedges several answers
in one output for the scorers. The contract of each task is in ``docs/task-contracts.md``.

Before: the checker said "correct"/"incorrect" to every guess, paid 1.0 per correct call and
1.0 again for the best guess, so five guesses with the answer among them scored 2.0 (one honest
correct answer scored 2.0 too); the interaction said "try again" until the answer came.
"""

from __future__ import annotations

from typing import Any

import pytest
from fault_helpers import tool_call, tool_engine, tool_messages

from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.builtin.gsm8k import Gsm8kTool
from agentloop_tools.interaction import Gsm8kInteraction
from agentloop_trainer.reward.scoring import BUILTIN_SCORERS, builtin_scorer

PROMPT = [{"role": "user", "content": "Ben has 5 coins and finds 7 more. How many coins?"}]
SAMPLING = {"temperature": 0.0}
GUESSES = ["10", "11", "12", "13", "14"]


def _checker_loop(tokenizer: Any, tool: Gsm8kTool, turns: list[str]) -> ToolAgentLoop:
    engine = tool_engine(tokenizer, lambda rid, i: turns[min(i, len(turns) - 1)])
    return ToolAgentLoop(engine, tokenizer, {"response_length": 4096, "tools": {tool.name: tool}})


async def _run_checker(tokenizer: Any, tool: Gsm8kTool, turns: list[str]) -> Any:
    return await _checker_loop(tokenizer, tool, turns).run(
        SAMPLING, raw_prompt=PROMPT, tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "12"}}})


async def test_answer_checker_cannot_be_searched(tokenizer):
    """A policy that submits five guesses, the answer among them, learns nothing from the
    checker after its first and is paid for its first (wrong) answer only."""
    search = [tool_call("check_answer", answer=g) for g in GUESSES] + ["#### 12"]
    out = await _run_checker(tokenizer, Gsm8kTool({}), search)
    messages = tool_messages(out)
    assert messages[0] == "Incorrect: 10 is not the answer."
    assert all(m.startswith("No attempts left") for m in messages[1:]), messages
    assert not any("Correct" in m or "Incorrect" in m for m in messages[1:])
    assert out.extra_fields["tool_rewards"] == [0.0] * len(GUESSES)
    assert out.reward_score == 0.0
    assert out.metrics["tool/check_answer/refused"] == len(GUESSES) - 1


async def test_answer_checker_pays_one_correct_answer_once(tokenizer):
    honest = [tool_call("check_answer", answer="12"), tool_call("check_answer", answer="12"), "#### 12"]
    out = await _run_checker(tokenizer, Gsm8kTool({}), honest)
    assert tool_messages(out)[0] == "Correct."
    assert out.reward_score == 1.0  # not 1.0 per correct call plus 1.0 for the best


async def test_answer_checker_scores_the_last_answer_when_retries_are_allowed(tokenizer):
    """The opt-in to retries (``max_attempts``) still reads the reward from the last checked
    answer, so a right guess followed by a wrong one is not rewarded."""
    turns = [tool_call("check_answer", answer="12"), tool_call("check_answer", answer="13"), "#### 13"]
    out = await _run_checker(tokenizer, Gsm8kTool({"max_attempts": 3}), turns)
    assert out.reward_score == 0.0
    best = await _run_checker(tokenizer, Gsm8kTool({"max_attempts": None, "score": "best"}), turns)
    assert best.reward_score == 1.0  # the documented opt-out: best of unlimited checked answers


async def test_interaction_does_not_say_try_again_until_the_answer_comes(tokenizer):
    engine = tool_engine(tokenizer, lambda rid, i: f"#### {GUESSES[min(i, len(GUESSES) - 1)]}")
    loop = ToolAgentLoop(engine, tokenizer, {"response_length": 4096, "interaction": Gsm8kInteraction(),
                                             "max_user_turns": 10})
    out = await loop.run(SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"ground_truth": "12"})
    assert out.metrics["assistant_turns"] == 1  # one answer, then the conversation ended
    assert out.reward_score == 0.0
    assert out.extra_fields["turn_scores"] == [0.0]


SCORED = sorted({fn.__name__: name for name, fn in BUILTIN_SCORERS.items()}.values()) + ["flexible"]


@pytest.mark.parametrize("data_source", SCORED)
@pytest.mark.parametrize("hedge", ["#### {a} or #### {b}", "The answer is {a}. The answer is {b}.",
                                   "\\boxed{{{a}}} \\boxed{{{b}}}", "#### {a}, {b}", "{a} or {b}"])
def test_scorers_read_one_answer_from_an_output_that_hedges(data_source, hedge):
    """An output naming two answers is paid for at most one of them, whichever the truth is."""
    source = "gsm8k" if data_source == "flexible" else data_source
    fn = builtin_scorer(source, "flexible" if data_source == "flexible" else "strict")
    assert fn is not None
    text = "Some working.\n" + hedge.format(a="42", b="43")
    paid = [fn(source, text, truth, {}) for truth in ("42", "43")]
    assert sum(paid) <= 1.0, (data_source, text, paid)
