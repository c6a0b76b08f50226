"""What a model trained on a chat template writes, and when one render of a conversation holds
every turn: references for tests of delta tokenization, computed from template renders alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.tokenization.renderer import ChatRenderer

_MARKER = "\u2063agentloop-turn-text\u2063"


class TemplateTurnError(ValueError):
    """The template renders an assistant turn in a way no engine output can reproduce."""


def template_turn_text(renderer: ChatRenderer, history: Sequence[Mapping[str, Any]],
                       message: Mapping[str, Any]) -> str:
    """The text a model trained on ``renderer``'s template writes for the assistant ``message``
    after ``history``: what the template renders for the turn after the generation prompt, up
    to and including the turn's closing special token (``<|im_end|>``, harmony's ``<|return|>``
    or ``<|call|>``, Mistral's ``</s>``), without the glue after it.

    Raises:
        TemplateTurnError: the turn does not start with the generation prompt (minus the extra
            text it adds, such as an empty think block), or does not end with a special token
            or the template's turn suffix.
    """
    with_prompt = renderer.render_text(history, add_generation_prompt=True)
    turn = renderer.render_text([*history, dict(message)], add_generation_prompt=False)
    extra = renderer.generation_prompt_extra
    if turn.startswith(with_prompt):
        body = turn[len(with_prompt):]
    elif extra and with_prompt.endswith(extra) and turn.startswith(with_prompt[: -len(extra)]):
        body = turn[len(with_prompt) - len(extra):]
    else:
        body = _body_after_moved_history(renderer, history, message, with_prompt, turn)
    suffix = renderer.assistant_suffix
    if suffix and body.endswith(suffix):
        glue = renderer.glue_after_assistant(True)
        return body[: len(body) - len(glue)] if glue and suffix.endswith(glue) else body
    stripped = body.rstrip()
    if any(stripped.endswith(token) for token in renderer.special_tokens):
        return stripped
    raise TemplateTurnError(
        f"the rendered assistant turn ends neither with the turn suffix {suffix!r} nor with a special token: "
        f"{body[-80:]!r}")


def _body_after_moved_history(renderer: ChatRenderer, history: Sequence[Mapping[str, Any]],
                              message: Mapping[str, Any], with_prompt: str, turn: str) -> str:
    """The turn's text when the template renders the history differently once the turn follows
    it (Mistral moves the system prompt into the last user message only): the turn starts where
    a plain assistant turn's content would, back to the end of the generation prompt when that
    is written there (harmony's ``<|channel|>final<|message|>`` and Qwen3's think block come
    after it, and the model writes them)."""
    without = renderer.render_text(history, add_generation_prompt=False)
    if not with_prompt.startswith(without):
        raise TemplateTurnError(
            "the template renders an assistant turn that does not start with its generation prompt:\n"
            f"  generation prompt render: {with_prompt[-80:]!r}\n  turn render: {turn[-120:]!r}")
    prompt = with_prompt[len(without):]
    plain = renderer.render_text([*history, {"role": "assistant", "content": _MARKER}], add_generation_prompt=False)
    before = plain[: plain.find(_MARKER)]
    start = before.rfind(prompt) + len(prompt) if prompt else len(before)
    if (prompt and before.rfind(prompt) < 0) or turn[:start] != before[:start]:
        raise TemplateTurnError(
            f"the template renders an assistant turn without its generation prompt {prompt!r} where its "
            f"content starts:\n  turn render: {turn[-120:]!r}")
    return turn[start:]


def one_render_holds(renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether one render of ``messages`` (with the generation prompt unless they end with an
    assistant turn) holds what the engine saw and wrote at every assistant turn: the prompt
    rendered up to that turn, then :func:`template_turn_text` of the turn, are a prefix of it.

    False for templates that render earlier turns differently once later messages exist (Qwen3
    drops reasoning and the last turn's empty think block, gpt-oss drops analysis and swaps
    ``<|return|>`` for ``<|end|>``, Mistral moves the system prompt and tools to the last user
    turn); then a trajectory is compared turn by turn, not with one render.
    """
    ends_generated = messages[-1].get("role") == "assistant"
    whole = renderer.render_text(messages, add_generation_prompt=not ends_generated)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:
            seen = renderer.render_text(messages[:i], add_generation_prompt=True)
            seen += template_turn_text(renderer, messages[:i], message)
        except TemplateTurnError:
            return False
        if not whole.startswith(seen):
            return False
    return True


# Special tokens the shared real templates write that the tiny tokenizer lacks, with the end of
# turn their models' tokenizers use as EOS (gpt-oss <|return|>, Mistral </s>, Llama 3 <|eot_id|>).
# Keyed by the start of the template file name (as saved in ../shared/data/chat_templates, or a
# built-in's file).
_FAMILY_TOKENS: dict[str, dict[str, Any]] = {
    "openai-gpt-oss": {"eos_token": "<|return|>", "additional_special_tokens": [
        "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]},
    "mistralai-": {"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": [
        "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]"]},
    # The built-in gemma-hermes template; as in Gemma's vocabulary, eos is <eos> and a turn ends
    # with another special token, <end_of_turn>.
    "gemma-": {"bos_token": "<bos>", "eos_token": "<eos>", "additional_special_tokens": [
        "<start_of_turn>", "<end_of_turn>"]},
    # The built-in llama3-json template (agentloop_core/tokenization/templates/llama3-json.jinja).
    "llama3-": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
        "<|python_tag|>"]},
}


def tiny_tokenizer_for_template(template_file: Any, *, chat_template: str | None = None) -> Any:
    """A fresh copy of the tiny tokenizer with the chat template in ``template_file`` and, for
    the harmony (gpt-oss), Mistral, Llama 3 and Gemma families, the special tokens their
    templates write, so a real template can be tested without its model's tokenizer.
    ``chat_template`` (a stand-in template of the same family) replaces the file's text; the
    file need not exist then."""
    from pathlib import Path

    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer

    path = Path(template_file)
    tok = load_tiny_tokenizer()
    for prefix, tokens in _FAMILY_TOKENS.items():
        if path.name.startswith(prefix):
            tok.add_special_tokens(tokens)
    tok.chat_template = path.read_text() if chat_template is None else chat_template
    return tok


COUNTING_TOOL_RESULTS_TEMPLATE = (
    "{%- set ns = namespace(n=0) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{%- set ns.n = ns.n + 1 %}"
    "{{- '<|im_start|>tool\\n#' ~ ns.n ~ ' ' ~ m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A ChatML template that numbers every tool result across the whole conversation, so what a
new tool message adds depends on turns before the last assistant turn (a delta rendered after
a short history is wrong for it)."""


class CountingProcessor:
    """A tokenizer stand-in that renders with ``tokenizer`` and counts the renders it is asked
    for (``rendered``): how tests see what a renderer or trajectory costs in template renders."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.rendered = 0

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        self.rendered += 1
        return self.tokenizer.apply_chat_template(messages, **kwargs)
