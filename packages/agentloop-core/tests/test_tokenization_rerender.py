"""Templates that render an assistant turn differently once later messages exist (Qwen3 drops the
empty think block of an assistant turn that a user message follows): new messages are appended
as what the template puts after that turn, never by raising mid-rollout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, Trajectory

# AGENTLOOP_CHAT_TEMPLATES points at the folder from a checkout that is not beside ../shared.
SHARED_QWEN3 = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                    or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates") / \
    "Qwen-Qwen3-0.6B.jinja"

# ChatML where an assistant turn that is not followed by a user message gets a "[open]" tag:
# the base conversation is then not a prefix of itself plus a user message.
TAGS_UNFOLLOWED_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and (loop.last or messages[loop.index0 + 1]['role'] != 'user') %}[open]{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The same, but the turn's end-of-turn text also changes once a user message follows.
CHANGES_THE_TURN_END = TAGS_UNFOLLOWED_TURNS.replace(
    "{{ m['content'] }}<|im_end|>\n{% endfor %}",
    "{{ m['content'] }}{% if not loop.last and messages[loop.index0 + 1]['role'] == 'user' %}<|endoftext|>"
    "{% else %}<|im_end|>{% endif %}\n{% endfor %}",
)


def _generated(tok, text: str) -> TokenOutput:
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="stop")


@pytest.mark.parametrize("strategy", ["auto", "history", "short"])
def test_a_user_turn_after_a_rerendered_assistant_turn_is_what_the_template_puts_after_it(strategy):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template=TAGS_UNFOLLOWED_TURNS, delta_strategy=strategy)
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    traj.append_generated(_generated(tok, "Hello there."))
    traj.append_messages([{"role": "user", "content": "Are you sure?"}])
    tail = tok.decode(traj.response_ids, skip_special_tokens=False)
    # The engine's tokens stay as generated; what follows is the user turn and the next prompt.
    assert tail == "Hello there.<|im_end|>\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    assert list(traj.response_mask) == [1] * len(_generated(tok, "Hello there.").token_ids) + \
        [0] * (len(traj.response_ids) - len(_generated(tok, "Hello there.").token_ids))


def test_a_template_that_also_changes_the_turn_end_follows_the_engines_stop_token():
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template=CHANGES_THE_TURN_END)
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    traj.append_generated(_generated(tok, "Hello."))
    traj.append_messages([{"role": "user", "content": "Sure?"}])
    # The template would close a followed turn with <|endoftext|>; the engine stopped on
    # <|im_end|>, which stays, and the delta starts after the template's close.
    tail = tok.decode(traj.response_ids, skip_special_tokens=False)
    # (the chat template environment trims the newline after a block tag: no glue here)
    assert tail == "Hello.<|im_end|><|im_start|>user\nSure?<|im_end|><|im_start|>assistant\n"
    assert traj.sanity_check("strict").ok
    # Cut by max_tokens, the turn gets the template's own close.
    cut = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    cut.append_generated(TokenOutput(tok.encode("Hel", add_special_tokens=False), stop_reason="length"))
    cut.append_messages([{"role": "user", "content": "Sure?"}])
    assert tok.decode(cut.response_ids, skip_special_tokens=False).startswith("Hel<|endoftext|><|im_start|>user")


@pytest.mark.skipif(not SHARED_QWEN3.exists(), reason="needs ../shared/data/chat_templates (absent in a fresh clone)")
def test_qwen3_user_follow_up_turns_append_without_raising():
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template=SHARED_QWEN3.read_text())
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 2 + 2?"}])
    for reply, follow_up in (("4", "Are you sure?"), ("Yes, 4.", "Thanks.")):
        traj.append_generated(_generated(tok, reply))
        traj.append_messages([{"role": "user", "content": follow_up}])
        tail = tok.decode(traj.response_ids, skip_special_tokens=False)
        assert tail.endswith(f"<|im_start|>user\n{follow_up}<|im_end|>\n<|im_start|>assistant\n")
    masked = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 1]
    assert tok.decode(masked, skip_special_tokens=False) == "4<|im_end|>Yes, 4.<|im_end|>"


# QwQ-like: reasoning stripped from earlier turns, and the generation prompt opens the think
# block, so the engine's turn starts inside it.
QWQ_LIKE = (
    "{%- for m in messages %}{%- set content = m.content or '' %}"
    "{%- if m.role == 'assistant' and '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# Llama-3.1-like: every message's content is trimmed.
TRIMMING = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n\\n' + (m.content or '') | trim + '<|im_end|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n\\n' }}{%- endif %}"
)


@settings(max_examples=30, deadline=None)
@given(contents=st.lists(st.sampled_from(["", " ", "\n", "\n\n", "x", "é 東京 🚀", "  padded  "]), min_size=2, max_size=6))
def test_qwq_like_generation_prompt_inside_the_think_block(contents):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template=QWQ_LIKE)
    traj = Trajectory(renderer, [{"role": "user", "content": contents[0]}])
    assert renderer.decode(traj.prompt_ids).endswith("<|im_start|>assistant\n<think>\n")
    for k, content in enumerate(contents[1:]):
        traj.append_generated(_generated(tok, f"step {k}\n</think>\n\n{content}"))
        traj.append_messages([{"role": "user", "content": content}])
        # every user turn ends with the generation prompt the engine then sees
        assert renderer.decode(traj.context_ids).endswith(f"{content}<|im_end|>\n<|im_start|>assistant\n<think>\n")
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()


def test_trimming_template_strict_semantics():
    tok = load_tiny_tokenizer()
    engine = ChatRenderer(tok, chat_template=TRIMMING)
    inference = ChatRenderer(tok, chat_template=TRIMMING, use_inference_chat_template=True)
    trajectories = []
    for renderer in (engine, inference):
        traj = Trajectory(renderer, [{"role": "user", "content": " Hi. "}])
        assert renderer.decode(traj.prompt_ids).endswith("user\n\nHi.<|im_end|><|im_start|>assistant\n\n")
        # The model wrote surrounding whitespace the template trims from a rendered turn.
        traj.append_generated(_generated(tok, "  Hello.\n"))
        traj.append_messages([{"role": "user", "content": "\tAgain "}])
        trajectories.append(traj)
    # The engine view compares what the engine saw and wrote: its whitespace is its own.
    assert trajectories[0].sanity_check("strict").ok
    # The inference view re-renders the turn trimmed: strict reports it, ignore_strippable
    # accepts a whitespace-only difference.
    assert not trajectories[1].sanity_check("strict").ok
    relaxed = trajectories[1].sanity_check("ignore_strippable")
    assert relaxed.ok
    assert "whitespace" in relaxed.reason


# Llama-3-like: turns close with <|eot_id|>, the tokenizer's EOS is <|end_of_text|>, and the
# engine may stop a turn on <|eom_id|> (a tool call) or <|eot_id|>: several stop ids.
LLAMA_LIKE = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content or '') | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("stop", ["<|eom_id|>", "<|eot_id|>"])
def test_the_glue_follows_the_token_the_engine_stopped_on(stop):
    tok = load_tiny_tokenizer()
    tok.add_special_tokens({"eos_token": "<|end_of_text|>", "additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]})
    renderer = ChatRenderer(tok, chat_template=LLAMA_LIKE)
    assert renderer.eos_token_id == tok.convert_tokens_to_ids("<|eot_id|>")  # the template's close, not EOS
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}])
    generated = tok.encode('{"name": "calc"}', add_special_tokens=False) + [tok.convert_tokens_to_ids(stop)]
    traj.append_generated(TokenOutput(generated, stop_reason="stop"))
    assert traj.messages[-1]["content"] == '{"name": "calc"}'  # the stop token is not content
    delta = traj.append_messages([{"role": "ipython", "content": "42"}])
    # The engine's own stop token stays; the template's <|eot_id|> close is not added after it.
    assert tok.decode(traj.response_ids, skip_special_tokens=False) == (
        '{"name": "calc"}' + stop + "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert list(traj.response_mask) == [1] * len(generated) + [0] * len(delta)
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()
