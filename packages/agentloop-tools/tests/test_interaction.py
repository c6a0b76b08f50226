"""Interactions (simulated users) inside the tool agent loop, on a scripted engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.builtin.gsm8k import Gsm8kTool
from agentloop_tools.interaction import (
    BaseInteraction,
    Gsm8kInteraction,
    extract_final_answer,
    load_interaction,
    load_interaction_config,
    load_interactions,
)

PROMPT = [{"role": "user", "content": "Ben has 5 coins and finds 7 more. How many coins?"}]
SAMPLING = {"temperature": 0.0}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def scripted(tokenizer, turns: list[str]) -> ScriptedServer:
    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True)


def run_loop(tokenizer, server, interaction: Any, **config: Any):
    return ToolAgentLoop(server, tokenizer, {"response_length": 2048, "interaction": interaction, **config})


@pytest.mark.parametrize(("text", "answer"), [("so #### 12", "12"), ("#### 1,234.5", "1234.5"),
                                              ("#### 3 then #### -4", "-4"), ("the answer is 12", None)])
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


async def test_interaction_asks_again_then_ends_on_the_right_answer(tokenizer):
    interaction = Gsm8kInteraction({"retry_message": "Wrong, try again.", "max_attempts": 2})
    server = scripted(tokenizer, ["#### 11", "#### 12"])
    out = await run_loop(tokenizer, server, interaction).run(
        SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"ground_truth": "12"})
    assert len(server.calls) == 2
    users = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "user"]
    assert users == [PROMPT[0]["content"], "Wrong, try again."]
    assert out.extra_fields["turn_scores"] == [0.0, 1.0]
    assert out.extra_fields["turn_rewards"] == [0.0, 1.0]  # each reply's score on the turn it answered
    assert out.extra_fields["termination_reason"] == "interaction"
    assert out.metrics["user_turns"] == 1
    assert out.metrics["assistant_turns"] == 2
    assert out.metrics["interaction/answered"] == 2  # both turns gave an answer (its metrics add up)
    assert [r["source"] for r in out.extra_fields["reported_metrics"]] == ["interaction"] * 2
    assert out.reward_score == 1.0  # the interaction's calculate_score: the last turn's score
    # The user reply is mask 0 and sits between the two generated turns.
    generated = [t for c in server.calls for t in c.output.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1] == generated
    reply_ids = tokenizer.encode("Wrong, try again.", add_special_tokens=False)
    zeros = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 0]
    assert any(zeros[i : i + len(reply_ids)] == reply_ids for i in range(len(zeros)))
    assert interaction.live_instances == 0


async def test_max_user_turns_ends_a_conversation_that_never_converges(tokenizer):
    interaction = Gsm8kInteraction({"max_attempts": None})
    server = scripted(tokenizer, ["#### 0"])
    out = await run_loop(tokenizer, server, interaction, max_user_turns=2).run(
        SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"ground_truth": "12"})
    assert len(server.calls) == 3
    assert out.metrics["user_turns"] == 2
    assert out.extra_fields["turn_scores"] == [0.0, 0.0]
    assert out.extra_fields["termination_reason"] == "max_user_turns"
    assert out.reward_score == 0.0


async def test_interaction_from_class_path_with_a_tool(tokenizer):
    spec = {"class_name": "agentloop_tools.interaction:Gsm8kInteraction", "config": {"correct_score": 2.0}}
    call = "<tool_call>\n" + json.dumps({"name": "check_answer", "arguments": {"answer": "12"}}) + "\n</tool_call>"
    server = scripted(tokenizer, [call, "#### 12"])
    tool = Gsm8kTool()
    loop = ToolAgentLoop(server, tokenizer, {"response_length": 2048, "interaction": spec, "tools": {tool.name: tool}})
    out = await loop.run(SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"ground_truth": 12},
                         tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "12"}}})
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["tool_errors"] == 0
    assert out.extra_fields["turn_scores"] == [2.0]
    assert out.extra_fields["termination_reason"] == "interaction"
    tool_rewards = out.extra_fields["tool_rewards"]
    assert tool_rewards == [0.0]  # a check earns nothing itself: the reward is calc_reward's, once
    calc = 1.0  # Gsm8kTool.calc_reward: the last checked answer, correct
    assert out.reward_score == pytest.approx(sum(tool_rewards) + calc + 2.0)
    # turn 0 made the call, turn 1 got the interaction's score
    assert out.extra_fields["turn_rewards"] == pytest.approx([sum(tool_rewards), 2.0])


def test_load_interaction_errors():
    assert load_interaction(None) is None
    inter = Gsm8kInteraction()
    assert load_interaction(inter) is inter
    with pytest.raises(ValueError, match="needs 'class_name'"):
        load_interaction({"config": {}})
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_interaction({"class_name": "no_such_mod:X"})
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_interaction({"class_name": "agentloop_tools.interaction:Nope"})
    with pytest.raises(ValueError, match="not a subclass of"):
        load_interaction({"class_name": "json:JSONDecoder"})
    with pytest.raises(ValueError, match="unknown keys"):
        load_interaction({"class_name": "agentloop_tools.interaction:Gsm8kInteraction", "cfg": {}})


async def test_lifecycle_and_missing_ground_truth():
    class Echo(BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            return False, "ok", 0.5, {}

    inter = Echo({"name": "echo"})
    iid = await inter.start(None, topic="x")
    assert inter.state(iid) == {"topic": "x"}
    assert inter.name == "echo"
    with pytest.raises(ValueError, match="already started"):
        await inter.start(iid)
    await inter.finalize(iid)
    with pytest.raises(KeyError, match="call start"):
        inter.state(iid)
    g = Gsm8kInteraction()
    gid = await g.start()
    with pytest.raises(ValueError, match="ground_truth"):
        await g.generate_response(gid, [{"role": "assistant", "content": "#### 1"}])


INTERACTION_YAML = """
interaction:
  - name: strict
    class_name: agentloop_tools.interaction.Gsm8kInteraction
    config: {retry_message: "Wrong."}
  - name: lenient
    class_name: agentloop_tools.interaction:Gsm8kInteraction
    config: {retry_message: "Close! Try once more.", correct_score: 2.0, max_attempts: 2}
"""


async def test_interaction_config_path_rows_pick_an_interaction_by_name(tokenizer, tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(INTERACTION_YAML)
    server = scripted(tokenizer, ["#### 11", "#### 12"])
    loop = ToolAgentLoop(server, tokenizer, {"response_length": 2048, "interaction_config_path": str(path)})
    assert sorted(loop.interactions) == ["lenient", "strict"]
    out = await loop.run(SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"name": "lenient", "ground_truth": "12"})
    users = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "user"]
    assert users[1:] == ["Close! Try once more."]
    assert out.extra_fields["turn_scores"] == [0.0, 2.0]
    assert out.reward_score == 2.0
    # The loaded file is shared by the next sample's loop (loops are built per sample).
    again = ToolAgentLoop(server, tokenizer, {"interaction_config_path": str(path)})
    assert again.interactions["strict"] is loop.interactions["strict"]
    with pytest.raises(ValueError, match=r"several interactions are configured \(\['lenient', 'strict'\]\)"):
        await loop.run(SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"ground_truth": "12"})
    with pytest.raises(ValueError, match=r"names interaction 'gsm8k', which is not configured"):
        await loop.run(SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"name": "gsm8k"})


async def test_interaction_kwargs_reach_start_whole(tokenizer):
    class Recording(BaseInteraction):
        started: list[dict[str, Any]] = []

        async def start(self, instance_id=None, **kwargs):
            self.started.append(kwargs)
            return await super().start(instance_id, **kwargs)

        async def generate_response(self, instance_id, messages, **kwargs):
            return True, "", 1.0, {}

    interaction = Recording({"name": "rec"})
    loop = run_loop(tokenizer, scripted(tokenizer, ["hi"]), interaction)
    # One interaction serves every row, whatever name the row gives (verl rows carry one).
    await loop.run(SAMPLING, raw_prompt=PROMPT, interaction_kwargs={"name": "gsm8k", "ground_truth": 3})
    assert Recording.started == [{"name": "gsm8k", "ground_truth": 3}]
    assert interaction.live_instances == 0


def test_interaction_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_interaction_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("interactions: []\n")
    with pytest.raises(ValueError, match="top-level 'interaction:' list"):
        load_interaction_config(bad)
    twice = [{"name": "a", "class_name": "agentloop_tools.interaction:Gsm8kInteraction"}] * 2
    with pytest.raises(ValueError, match=r"interaction\[1\]: two interactions are named 'a'"):
        load_interactions(twice)
    with pytest.raises(ValueError, match=r"interaction\[0\]: .*needs 'class_name'"):
        load_interactions({"interaction": [{"name": "a"}]})
    assert load_interactions(None) == {}
    with pytest.raises(ValueError, match="both 'interaction' and 'interaction_config_path'"):
        ToolAgentLoop(object(), load_tiny_tokenizer(), {"interaction": Gsm8kInteraction(),
                                                        "interaction_config_path": "x.yaml"})
