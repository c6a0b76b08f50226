"""A chat template that cannot render a minimal conversation with the renderer's tools fails at
``ChatRenderer(...)`` with a :class:`ChatTemplateError` naming its failure and the fix; our own
errors pass through unchanged, and templates that work render as before."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from agentloop_core.testing import CountingProcessor, load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_core.tokenization.renderer import ChatRenderer
from agentloop_core.tokenization.template_errors import (
    ChatTemplateError,
    raised_by_template,
    template_refusal,
)

TOOLS = [{
    "type": "function",
    "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                 "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}},
}]
CHATML_TURNS = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Like the tool_use variants of Hermes / Llama templates: the schemas are iterated unconditionally.
NEEDS_TOOLS = (
    "{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}" + CHATML_TURNS
)
REFUSES_WITHOUT_TOOLS = "{%- if not tools %}{{- raise_exception('This template needs tools.') }}{%- endif %}" + CHATML_TURNS

SHARED_TEMPLATES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates"
def test_a_template_that_needs_tools_names_the_failure_and_the_fix():
    tok = load_tiny_tokenizer()
    with pytest.raises(ChatTemplateError) as caught:
        ChatRenderer(tok, chat_template=NEEDS_TOOLS)
    message = str(caught.value)
    assert "with no tools: TypeError: 'NoneType' object is not iterable (template line 1)" in message, message
    assert "this chat template needs tools=...; configure tools" in message, message
    assert "or use the model's default template" in message, message
    assert isinstance(caught.value, ValueError)
    assert caught.value.refusal is None
    assert isinstance(caught.value.__cause__, TypeError)  # the template's own error stays in the chain
    renderer = ChatRenderer(tok, chat_template=NEEDS_TOOLS, tools=TOOLS)
    messages = [{"role": "user", "content": "Hi."}]
    assert renderer.render_text(messages, add_generation_prompt=True) == tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=NEEDS_TOOLS, add_generation_prompt=True, tokenize=False)


def test_a_template_refusal_carries_the_template_message():
    tok = load_tiny_tokenizer()
    with pytest.raises(ChatTemplateError, match=r"refuses a minimal conversation .* with no tools: "
                                                r"raise_exception\('This template needs tools.'\)") as caught:
        ChatRenderer(tok, chat_template=REFUSES_WITHOUT_TOOLS)
    assert caught.value.refusal == "This template needs tools."
    assert template_refusal(caught.value) == "This template needs tools."
    assert "configure tools" in str(caught.value)
    ChatRenderer(tok, chat_template=REFUSES_WITHOUT_TOOLS, tools=TOOLS)


def test_a_template_that_fails_with_tools_too_is_not_told_to_configure_tools():
    tok = load_tiny_tokenizer()
    broken = "{{- messages[0].content.no_such.attribute }}" + CHATML_TURNS
    with pytest.raises(ChatTemplateError, match=r"with tools=\[calc\]: UndefinedError") as caught:
        ChatRenderer(tok, chat_template=broken, tools=TOOLS)
    assert "configure tools" not in str(caught.value)
    assert "pass a chat_template=" in str(caught.value)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatRenderer(tok, chat_template="{%- for m in messages %}{{ m.content }")


class _CrashingProcessor:
    """A processor whose own Python code raises TypeError: our bug, not the template's."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template

    def apply_chat_template(self, messages, **kwargs):
        raise TypeError("'NoneType' object is not iterable")


def test_an_error_outside_the_template_is_not_blamed_on_it():
    with pytest.raises(TypeError, match="not iterable") as caught:
        ChatRenderer(_CrashingProcessor(load_tiny_tokenizer()))
    assert not isinstance(caught.value, ChatTemplateError)
    assert not raised_by_template(caught.value)
    assert template_refusal(caught.value) is None


def test_the_check_costs_no_render_for_a_template_that_works():
    # Loops build one renderer per sample: construction renders only the probes it needs anyway
    # (turn suffix, generation prompt); the error check rides on them. The first renderer of a
    # template also checks once that a turn can be cut from its render. Later renderers of the
    # same tokenizer and template reuse the probes (see test_renderer_cache.py).
    from agentloop_core.tokenization import renderer as renderer_module

    processor = CountingProcessor(load_tiny_tokenizer())
    renderer_module._SPLITS.clear()
    ChatRenderer(processor, tools=TOOLS)
    assert processor.rendered == 5
    ChatRenderer(processor, tools=TOOLS)
    assert processor.rendered == 5


def test_template_refusal_ignores_jinja_errors_that_are_not_refusals():
    env = jinja2.Environment()
    with pytest.raises(jinja2.UndefinedError) as caught:
        env.from_string("{{ x.y }}").render()
    assert raised_by_template(caught.value)
    assert template_refusal(caught.value) is None


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja",
                                  "mistralai-Mistral-Nemo-Instruct-2407.jinja"])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
def test_shared_templates_construct(name, tools):
    path = SHARED_TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (the shared chat templates are not part of a fresh clone)")
    tok = tiny_tokenizer_for_template(path)
    renderer = ChatRenderer(tok, tools=tools)
    messages = [{"role": "user", "content": "Hi."}]
    assert renderer.render_text(messages, add_generation_prompt=True) == tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)
