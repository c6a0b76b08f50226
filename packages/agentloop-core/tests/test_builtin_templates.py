"""The built-in tool-aware chat templates: what they render for tools, tool calls and tool
results, that their tool parser reads back the calls they render, and that a multi-turn tool
trajectory built on them passes the strict sanity check, on the tiny tokenizer and on every
tokenizer folder listed in AGENTLOOP_TOKENIZER_DIRS (colon-separated; e.g. a SmolLM2 checkout,
whose own template ignores tools=).

A failure in the trajectory tests means delta tokenization and the template disagree: compare
``report.describe()`` with the template's render of ``written``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentloop_core.parsers import get_tool_parser
from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import (
    load_tiny_tokenizer,
    one_render_holds,
    template_turn_text,
    tiny_tokenizer_for_template,
)
from agentloop_core.tokenization import (
    ChatRenderer,
    Trajectory,
    chat_template_names,
    renders_tools,
    resolve_chat_template,
    set_chat_template,
)
from agentloop_core.tokenization.builtin_templates import BUILTINS, builtin_chat_template

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

PLAIN_CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""A ChatML template that never reads ``tools`` (as SmolLM2's, without its default system prompt)."""

NEEDS = {"chatml-hermes": ("<|im_start|>", "<|im_end|>"), "llama3-json": ("<|start_header_id|>", "<|eot_id|>"),
         "gemma-hermes": ("<start_of_turn>", "<end_of_turn>")}
"""Tokens each built-in writes as turn markers: a tokenizer must have each as one token."""


def tiny_with(name: str):
    """A fresh tiny tokenizer with the built-in ``name`` (and, for llama3-json and gemma-hermes,
    their family's special tokens)."""
    return tiny_tokenizer_for_template(BUILTINS[name].file, chat_template=resolve_chat_template(name))


def _real_folders() -> list:
    return [pytest.param(folder, id=Path(folder).name or folder)
            for folder in filter(None, os.environ.get("AGENTLOOP_TOKENIZER_DIRS", "").split(":"))]


def _sources() -> list:
    params = [pytest.param(("tiny", name), id=f"tiny-{name}") for name in chat_template_names()]
    for folder in _real_folders():
        params += [pytest.param((folder.values[0], name), id=f"{folder.id}-{name}") for name in chat_template_names()]
    return params


@pytest.fixture(params=_sources())
def tok(request):
    source, name = request.param
    if source == "tiny":
        return tiny_with(name)
    from transformers import AutoTokenizer

    folder = Path(source)
    if not folder.is_dir():
        pytest.fail(f"AGENTLOOP_TOKENIZER_DIRS lists {folder}, which is not a folder")
    tok = AutoTokenizer.from_pretrained(str(folder))
    missing = [t for t in NEEDS[name] if len(tok.encode(t, add_special_tokens=False)) != 1]
    if missing:
        pytest.skip(f"{folder.name} has no single tokens for {missing}, which {name} writes")
    return set_chat_template(tok, name)


def parser_for(tok):
    name = next(n for n, t in BUILTINS.items() if builtin_chat_template(n) == tok.chat_template)
    return get_tool_parser(BUILTINS[name].tool_parser)


CALLS = [{"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                           "arguments": json.dumps({"expression": "6 * 7"})}},
         {"id": "call_2", "type": "function", "function": {"name": "calculator",
                                                           "arguments": {"expression": "40 + 2"}}}]


def test_names_resolve_and_unknown_names_list_the_builtins(tmp_path):
    assert set(chat_template_names()) >= {"chatml-hermes", "gemma-hermes", "llama3-json"}
    assert "<tool_call>" in resolve_chat_template("chatml-hermes")
    path = tmp_path / "mine.jinja"
    path.write_text(PLAIN_CHATML)
    assert resolve_chat_template(path) == resolve_chat_template(str(path)) == PLAIN_CHATML
    assert resolve_chat_template(PLAIN_CHATML) == PLAIN_CHATML  # the text itself, as verl's key holds it
    with pytest.raises(ValueError, match=r"'chatml-hermis' \(did you mean 'chatml-hermes'\?\).*chatml-hermes, "
                                         r"gemma-hermes, llama3-json.*a path to a Jinja file"):
        resolve_chat_template("chatml-hermis")
    with pytest.raises(ValueError, match="is a folder"):
        resolve_chat_template(tmp_path)


def test_chatml_hermes_renders_tools_calls_and_results():
    tok = tiny_with("chatml-hermes")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "6 * 7?"}]},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_2", "content": "42"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")  # the given system message is kept
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n" in text  # text parts joined
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "40 + 2"}}\n</tool_call>'
            '<|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n42\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Without tools: plain ChatML, the system message still there, no tool section.
    plain = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"


def test_gemma_hermes_renders_tools_calls_and_results():
    tok = tiny_with("gemma-hermes")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "6 * 7?"}]},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_2", "content": "42"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # BOS, then Gemma's first user turn: the system text, the tools, then the user's own text.
    first = text[: text.index("<end_of_turn>")]
    assert first.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in first
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n' in first
    assert first.endswith("</tool_call>\n\nWhat is 6 * 7?")  # text parts joined, after the tool section
    assert "system" not in text.replace("<start_of_turn>user\nBe brief.", "")  # no system turn
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "40 + 2"}}\n</tool_call>'
            '<end_of_turn>\n') in text
    assert text.endswith("<start_of_turn>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n42\n"
                         "</tool_response><end_of_turn>\n<start_of_turn>model\n")
    # Without tools: Gemma's own layout (system folded into the first user turn, a blank line after it).
    plain = tok.apply_chat_template(messages[:2] + [{"role": "assistant", "content": "42."}], tokenize=False)
    assert plain == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 6 * 7?<end_of_turn>\n"
                     "<start_of_turn>model\n42.<end_of_turn>\n")
    # Content is kept as written (Gemma's own template trims it): a generated turn re-renders as generated.
    spaced = tok.apply_chat_template([{"role": "user", "content": " hi \n"}], tokenize=False)
    assert spaced == "<bos><start_of_turn>user\n hi \n<end_of_turn>\n"
    # A system message with nothing to fold into is a user turn of its own.
    alone = tok.apply_chat_template(messages[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert alone.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools")
    assert alone.endswith("</tool_call><end_of_turn>\n<start_of_turn>model\n")


def test_llama3_json_renders_tools_calls_and_results():
    tok = tiny_with("llama3-json")
    messages = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "", "tool_calls": CALLS},
                {"role": "tool", "content": "42"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert json.dumps(TOOLS[0]) + "<|eot_id|>" in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calculator", "parameters": {"expression": '
            '"6 * 7"}}; {"name": "calculator", "parameters": {"expression": "40 + 2"}}<|eot_id|>') in text
    assert text.endswith("<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("name", chat_template_names())
def test_builtins_render_tools_and_plain_chatml_does_not(name):
    assert renders_tools(tiny_with(name))
    tok = load_tiny_tokenizer()
    tok.chat_template = PLAIN_CHATML
    assert not renders_tools(tok)
    assert renders_tools(tok, chat_template=resolve_chat_template(name))


@pytest.mark.parametrize("name", chat_template_names())
def test_content_parts_other_than_text_are_refused(name):
    tok = tiny_with(name)
    with pytest.raises(Exception, match="renders text content only"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                                tokenize=False)


def test_the_tool_parser_reads_back_the_calls_the_template_renders(tok):
    renderer = ChatRenderer(tok, tools=TOOLS)
    history = [{"role": "user", "content": "What is 6 * 7?"}]
    turn = template_turn_text(renderer, history, {"role": "assistant", "content": "", "tool_calls": CALLS})
    parsed = parser_for(tok).parse(turn.removesuffix(renderer.eos_text or ""), {"calculator": TOOLS[0]})
    assert not parsed.errors, parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "6 * 7"}),
                                                           ("calculator", {"expression": "40 + 2"})]


def engine_turn(renderer: ChatRenderer, traj: Trajectory, written: list[dict], message: dict) -> TokenOutput:
    """What a model trained on the template generates for ``message``: the template's text of
    the turn (closing token included), tokenized in context."""
    text = template_turn_text(renderer, written, message)
    context = traj.context_ids
    joint = renderer.encode(renderer.decode(context) + text)
    ids = joint[len(context):] if joint[: len(context)] == context else renderer.encode(text)
    return TokenOutput(ids, [-0.1] * len(ids))


def test_multi_turn_tool_trajectory_passes_the_strict_sanity_check(tok):
    renderer = ChatRenderer(tok, tools=TOOLS)
    parser = parser_for(tok)
    written = [{"role": "system", "content": "You solve arithmetic with the calculator."},
               {"role": "user", "content": "What is 6 * 7, and 40 + 2?"}]
    traj = Trajectory(renderer, written, sanity_check="strict")
    script = [
        ({"role": "assistant", "content": "", "tool_calls": CALLS},
         [{"role": "tool", "tool_call_id": "call_1", "content": "42"},
          {"role": "tool", "tool_call_id": "call_2", "content": "42"}]),
        ({"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
         [{"role": "tool", "tool_call_id": "call_1", "content": "42"}]),
        ({"role": "assistant", "content": "Both are 42."}, [{"role": "user", "content": "Thanks. And 2 + 2?"}]),
        ({"role": "assistant", "content": "4."}, []),
    ]
    generated = []
    for message, follow in script:
        out = engine_turn(renderer, traj, written, message)
        reply = traj.append_generated(out)
        generated.extend(out.token_ids)
        calls = parser.parse(reply["content"], {"calculator": TOOLS[0]}).calls
        assert len(calls) == len(message.get("tool_calls") or [])  # the model's calls read back
        written.append(message)
        if follow:
            traj.append_messages(follow)
            written.extend(follow)
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()
    assert [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m] == generated
    # The template is prefix-stable: one render of the conversation as an OpenAI client would
    # send it (structured tool_calls) holds every turn as the engine saw and wrote it.
    assert one_render_holds(renderer, written)
    whole = renderer.encode(renderer.render_text(written, add_generation_prompt=False))
    assert whole[: len(traj.context_ids)] == traj.context_ids
    assert renderer.decode(whole[len(traj.context_ids):]).strip() == ""
