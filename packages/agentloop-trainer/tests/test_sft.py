"""SFT demonstrations are tokenized exactly as the tool_agent loop builds a rollout."""

from __future__ import annotations

import random

import pytest

from agentloop_trainer.stages.sft import sft_loss, tokenize_conversation
from agentloop_trainer.task import demonstration, make_problems, tool_schemas


def test_demo_tokens_equal_tool_agent_rollout_tokens(tokenizer):
    import asyncio

    from agentloop_core.testing import ScriptedServer
    from agentloop_tools.agent_loop import ToolAgentLoop
    from agentloop_trainer.task import calculator_tool

    problem = make_problems(1, 7)[0]
    demo = demonstration(problem, random.Random(0), flip_prob=0.0)
    tc = tokenize_conversation(tokenizer, demo, tool_schemas())
    # the assistant turns exactly as SFT teaches them, replayed by a scripted engine
    turns = tc.assistant_turns()
    assert len(turns) == 2
    server = ScriptedServer(turns)
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"calculator": calculator_tool()}, "tool_reward": "none",
                                             "response_length": 256, "sanity_check": "strict"})
    out = asyncio.run(loop.run({"max_tokens": 64}, raw_prompt=demo[:2]))
    assert out.prompt_ids + out.response_ids == tc.input_ids
    assert out.response_mask == tc.loss_mask[len(out.prompt_ids):]
    assert tokenizer.decode(out.response_ids).endswith(f"#### {problem.answer}<|im_end|>")
    # Skipping the per-turn prefix check (as SFT does after its first step) changes nothing.
    assert tokenize_conversation(tokenizer, demo, tool_schemas(), check_prefix=False) == tc


def test_a_template_that_renders_history_differently_is_caught_by_the_prefix_check(tokenizer):
    import copy

    demo = demonstration(make_problems(1, 2)[0], random.Random(0), flip_prob=0.0)
    odd = copy.copy(tokenizer)
    # Like templates that strip reasoning from earlier turns: the last assistant message is
    # rendered with a marker, earlier ones without it.
    odd.chat_template = tokenizer.chat_template.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- if loop.last and message.role == 'assistant' %}[last]{%- endif %}", 1)
    assert odd.chat_template != tokenizer.chat_template, "the template changed shape; update this test"
    with pytest.raises(ValueError, match="does not render message 2 as an extension of the history"):
        tokenize_conversation(odd, demo, tool_schemas())


def test_loss_mask_covers_assistant_turns_only(tokenizer):
    tc = tokenize_conversation(tokenizer, demonstration(make_problems(1, 1)[0], random.Random(0)), tool_schemas())
    trained = tokenizer.decode([t for t, m in zip(tc.input_ids, tc.loss_mask, strict=True) if m])
    assert trained.startswith("<tool_call>")
    assert trained.count("<|im_end|>") == 2
    assert "tool_response" not in trained
    assert "Solve" not in trained


def test_last_message_must_be_assistant(tokenizer):
    demo = demonstration(make_problems(1, 1)[0], random.Random(0))
    with pytest.raises(ValueError, match="assistant"):
        tokenize_conversation(tokenizer, demo[:-1], tool_schemas())


def test_sft_steps_reduce_loss(random_model_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages.sft import demonstration_batch
    from agentloop_trainer.task import BIASED_TEMPLATES

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    batch = demonstration_batch(tokenizer, make_problems(8, 2), random.Random(0), 0.6, BIASED_TEMPLATES)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        loss = sft_loss(model, batch)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(sft_loss(model, batch).detach()) < 0.8 * first


@pytest.mark.parametrize(("stop_loss", "runs"), [(1e3, 1), (None, 1), (1e-9, 3)])
def test_sft_repeats_its_schedule_until_learned_within_max_steps(random_model_path, tokenizer, stop_loss, runs):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages.sft import SFTConfig, learned, train_sft
    from agentloop_trainer.task import BIASED_TEMPLATES

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    # 3 whole runs of 6 steps fit in 20; a 4th would not. A random model's loss is never below 1e-9.
    config = SFTConfig(steps=6, batch_size=1, lr=1e-4, warmup_steps=2, stop_loss=stop_loss, max_steps=20)
    losses = train_sft(model, tokenizer, make_problems(16, 3), config, BIASED_TEMPLATES)
    assert len(losses) == runs * config.steps
    assert learned(losses, stop_loss) == (stop_loss != 1e-9)


def test_the_tiny_policy_has_heads_of_32_and_refuses_heads_that_do_not_divide_its_width(tokenizer):
    """A width its heads do not divide is a clear error naming both, not a shape error deep in
    the rotary embedding."""
    from agentloop_trainer.policy import TinyModelConfig, build_tiny_policy

    config = build_tiny_policy(tokenizer, seed=0).config
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (128, 4, 512)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 does not divide hidden_size=90.*2 heads of 45"):
        build_tiny_policy(tokenizer, spec=TinyModelConfig(hidden_size=90))
