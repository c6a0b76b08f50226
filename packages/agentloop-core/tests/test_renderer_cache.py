"""The construction probes a ``ChatRenderer`` renders are worked out once per tokenizer and
template and reused by later renderers (loops build one per trajectory), without keeping the
tokenizer alive and without ever answering for a template, tools or special tokens they were
not probed with."""

from __future__ import annotations

import gc
import weakref

import pytest

from agentloop_core.testing import CountingProcessor, load_tiny_tokenizer
from agentloop_core.tokenization import template_probes
from agentloop_core.tokenization.renderer import ChatRenderer
from agentloop_core.tokenization.template_errors import ChatTemplateError

TOOLS = [{
    "type": "function",
    "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                 "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}},
}]
# ChatML, but a blank line after every turn and an empty think block in the generation prompt:
# every probed field differs from the tiny tokenizer's own template.
SPACED = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think></think>' }}{%- endif %}"
)
REFUSES = "{{- raise_exception('No.') }}"


class _NoWeakref:
    """A counting processor that cannot be held weakly (``__slots__`` without ``__weakref__``)."""

    __slots__ = ("tokenizer", "chat_template", "rendered")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.rendered = 0

    def apply_chat_template(self, messages, **kwargs):
        self.rendered += 1
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def _probed(renderer: ChatRenderer) -> tuple:
    return (renderer.assistant_suffix, renderer.eos_token_id, renderer.eos_text,
            renderer.generation_prompt_extra, renderer._special_pattern)


def test_a_second_renderer_reuses_the_probes_and_gets_the_same_answers():
    processor = CountingProcessor(load_tiny_tokenizer())
    first = ChatRenderer(processor, tools=TOOLS)
    after_first = processor.rendered
    second = ChatRenderer(processor, tools=TOOLS)
    assert processor.rendered == after_first  # no render at all
    assert _probed(second) == _probed(first)
    # A tokenizer the cache has never seen works the same answers out again.
    fresh = CountingProcessor(load_tiny_tokenizer())
    assert _probed(ChatRenderer(fresh, tools=TOOLS)) == _probed(first)
    assert fresh.rendered > 0


def test_a_template_changed_in_place_is_probed_again():
    processor = CountingProcessor(load_tiny_tokenizer())
    chatml = ChatRenderer(processor)
    processor.chat_template = processor.tokenizer.chat_template = SPACED
    before = processor.rendered
    spaced = ChatRenderer(processor)
    assert processor.rendered > before
    assert spaced.assistant_suffix == "<|im_end|>\n\n"
    assert chatml.assistant_suffix == "<|im_end|>\n"
    assert spaced.generation_prompt_extra == "<think></think>"
    assert chatml.generation_prompt_extra == ""


@pytest.mark.parametrize("change", ["tools", "chat_template", "apply_chat_template_kwargs"])
def test_other_tools_template_or_variables_are_probed_again(change):
    processor = CountingProcessor(load_tiny_tokenizer())
    ChatRenderer(processor)
    before = processor.rendered
    kwargs = {"tools": {"tools": TOOLS}, "chat_template": {"chat_template": SPACED},
              "apply_chat_template_kwargs": {"apply_chat_template_kwargs": {"enable_thinking": False}}}[change]
    ChatRenderer(processor, **kwargs)
    assert processor.rendered > before


def test_added_special_tokens_are_probed_again():
    tok = load_tiny_tokenizer()
    processor = CountingProcessor(tok)
    ChatRenderer(processor)
    before = processor.rendered
    tok.add_special_tokens({"additional_special_tokens": ["<|agentloop_test_marker|>"]})
    renderer = ChatRenderer(processor)
    assert processor.rendered > before
    assert "<|agentloop_test_marker|>" in renderer.special_tokens


def test_a_failing_template_fails_at_every_construction():
    processor = CountingProcessor(load_tiny_tokenizer())
    processor.chat_template = processor.tokenizer.chat_template = REFUSES
    for _ in range(2):
        before = processor.rendered
        with pytest.raises(ChatTemplateError, match=r"raise_exception\('No.'\)"):
            ChatRenderer(processor, tools=TOOLS)
        assert processor.rendered > before  # the failure was not cached as an answer


def test_the_cache_does_not_keep_the_tokenizer_alive():
    processor = CountingProcessor(load_tiny_tokenizer())
    ChatRenderer(processor)
    assert processor in template_probes._PROBES
    ref = weakref.ref(processor)
    entries = len(template_probes._PROBES)
    del processor
    gc.collect()
    assert ref() is None
    assert len(template_probes._PROBES) == entries - 1


def test_a_processor_that_cannot_be_held_weakly_is_probed_every_time():
    processor = _NoWeakref(load_tiny_tokenizer())
    with pytest.raises(TypeError):
        weakref.ref(processor)
    first = ChatRenderer(processor)
    after_first = processor.rendered
    second = ChatRenderer(processor)
    assert processor.rendered > after_first
    assert _probed(second) == _probed(first)
