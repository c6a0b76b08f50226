"""Construction probes: what a chat template puts around an assistant turn, worked out once.

A :class:`~agentloop_core.tokenization.ChatRenderer` needs three facts about its template
before it can append deltas: the text after an assistant turn's content (ChatML's
``<|im_end|>\\n``) and the end-of-turn token in it, and what the generation prompt adds after
the assistant header (an empty think block). Four renders of fixed probe conversations give
them; they are the template's first renders, so a template that cannot be used with these tools
fails here, with a message naming the fix, instead of deep inside the first rollout.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentloop_core.tokenization.opaque import BASE_CONVERSATION
from agentloop_core.tokenization.template_errors import (
    ChatTemplateError,
    raised_by_template,
    template_line,
    template_refusal,
)

__all__ = ["PROBE_MARKER", "TemplateProbes", "probes_for", "run_probes", "special_tokens"]

PROBE_MARKER = "\u2063agentloop-probe-7d1f\u2063"
"""Content no real conversation contains, so its position in a rendered probe is unambiguous."""

# Only rendered when the template failed without tools, to tell "needs tools" from other failures.
_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "probe", "description": "Probe.", "parameters": {"type": "object", "properties": {}}},
}


class ProbedRenderer(Protocol):
    """What the probes read from the renderer being built."""

    processor: Any
    tokenizer: Any
    tools: list[dict] | None
    chat_template: str | None
    apply_chat_template_kwargs: dict[str, Any]
    special_tokens: tuple[str, ...]

    def render_text(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class TemplateProbes:
    """What construction works out from renders of fixed probe conversations."""

    assistant_suffix: str
    """The text the template writes after an assistant turn's content."""
    eos_token_id: int | None
    """The id of the end-of-turn token that suffix starts with (else the tokenizer's EOS id)."""
    eos_text: str | None
    """That token's text."""
    generation_prompt_extra: str
    """Text the generation prompt adds after the assistant header that a rendered turn lacks."""
    special_pattern: re.Pattern[str] | None
    """Matches any of the tokenizer's single-id special tokens (the tokens that close a turn)."""


# Per tokenizer (or processor) and template key: the construction probes, four renders, which
# loops that build one renderer per trajectory would otherwise repeat for every sample. The
# tokenizer is held weakly: its entry goes away with it, and a new tokenizer allocated where a
# freed one lived never hits the old entry (as it could with ``id()`` keys). The key holds
# everything a probe reads (template text, tools, template variables, the special tokens with
# their ids, bos/eos), so a tokenizer changed in place (new template, added special tokens)
# probes again. Only successful probes are kept: a template that fails keeps failing at every
# construction with its message.
_PROBES: weakref.WeakKeyDictionary[Any, dict[tuple, TemplateProbes]] = weakref.WeakKeyDictionary()


def probes_for(processor: Any) -> dict[tuple, TemplateProbes]:
    """``processor``'s probe cache; a fresh, unshared one when it cannot be a weak key."""
    try:
        entry = _PROBES.get(processor)
        if entry is None:
            entry = _PROBES[processor] = {}
        return entry
    except TypeError:  # no __weakref__ slot, or unhashable
        return {}


def run_probes(renderer: ProbedRenderer) -> TemplateProbes:
    """Run the construction probes on ``renderer``'s template (see :data:`_PROBES` for why
    callers keep the result).

    Raises:
        ChatTemplateError: when the template refuses or fails on a probe; the message names the
            failure and the fix. Turning the failure into an error costs no extra render.
        ValueError: when the template drops assistant content.
    """
    tokens = renderer.special_tokens
    pattern = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
    try:
        suffix, eos_id, eos_text = _assistant_suffix(renderer)
        extra = _generation_prompt_extra(renderer)
    except Exception as exc:
        if not raised_by_template(exc):
            raise
        raise _template_error(renderer, exc) from exc
    return TemplateProbes(suffix, eos_id, eos_text, extra, pattern)


def _assistant_suffix(renderer: ProbedRenderer) -> tuple[str, int | None, str | None]:
    probe = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": PROBE_MARKER}]
    text = renderer.render_text(probe, add_generation_prompt=False)
    at = text.rfind(PROBE_MARKER)
    if at < 0:
        raise ValueError(
            "the chat template does not render assistant content verbatim, so the end of an "
            "assistant turn cannot be found; pass a chat_template= that renders "
            "message.content"
        )
    suffix = text[at + len(PROBE_MARKER) :]
    eos_text, eos_id = _end_of_turn_token(renderer, suffix)
    return suffix, eos_id, eos_text


def _generation_prompt_extra(renderer: ProbedRenderer) -> str:
    """Text the generation prompt adds after the assistant header, which a rendered
    assistant turn in history does not contain (e.g. an empty ``<think></think>`` block when
    thinking is switched off). The engine saw it, so it belongs to the training view."""
    user = [{"role": "user", "content": "Hi."}]
    before = renderer.render_text(user, add_generation_prompt=False)
    with_prompt = renderer.render_text(user, add_generation_prompt=True)
    turn = renderer.render_text([*user, {"role": "assistant", "content": PROBE_MARKER}], add_generation_prompt=False)
    if not (with_prompt.startswith(before) and turn.startswith(before)):
        return ""
    generation_prompt = with_prompt[len(before) :]
    header = turn[len(before) : turn.rfind(PROBE_MARKER)]
    if generation_prompt.startswith(header):
        return generation_prompt[len(header) :]
    return ""


def _end_of_turn_token(renderer: ProbedRenderer, suffix: str) -> tuple[str | None, int | None]:
    tok = renderer.tokenizer
    candidates: list[str] = []
    if getattr(tok, "eos_token", None):
        candidates.append(tok.eos_token)
    # The turn may close with a special token other than eos_token (Llama 3's <|eot_id|>), or with
    # an added token marked special that all_special_tokens does not list (Gemma's <end_of_turn>):
    # renderer.special_tokens holds both kinds, longest first.
    candidates += sorted(getattr(tok, "all_special_tokens", []) or [], key=len, reverse=True)
    candidates += renderer.special_tokens
    for cand in candidates:
        if cand and suffix.startswith(cand):
            ids = renderer.encode(cand)
            if len(ids) == 1:
                return cand, ids[0]
    eos_id = getattr(tok, "eos_token_id", None)
    return getattr(tok, "eos_token", None), eos_id if isinstance(eos_id, int) else None


def _template_error(renderer: ProbedRenderer, exc: Exception) -> ChatTemplateError:
    """The error for a template that failed on the construction probes: what it did, and
    the fix (configure tools when it renders with a tool but not without)."""
    from jinja2 import TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return ChatTemplateError(
            f"the chat template does not compile: {exc} (template line {exc.lineno}); fix it, or use the "
            "model's default template"
        )
    refusal = template_refusal(exc)
    line = template_line(exc)
    if refusal is not None:
        verb, failure = "refuses", f"raise_exception({refusal!r})"
    else:
        verb, failure = "cannot render", f"{type(exc).__name__}: {exc}" + (f" (template line {line})" if line else "")
    tools = "no tools" if renderer.tools is None else f"tools={_tool_names(renderer.tools)}"
    message = f"the chat template {verb} a minimal conversation (one user message, one reply) with {tools}: {failure}"
    if renderer.tools is None and _renders_with_a_tool(renderer):
        message += ("; this chat template needs tools=...; configure tools (ChatRenderer(tools=[...]), or the "
                    "agent loop's tools), or use the model's default template")
    else:
        message += "; pass a chat_template= that renders it, or use the model's default template"
    return ChatTemplateError(message, refusal=refusal)


def _renders_with_a_tool(renderer: ProbedRenderer) -> bool:
    try:
        renderer.processor.apply_chat_template(
            list(BASE_CONVERSATION), tools=[_PROBE_TOOL], chat_template=renderer.chat_template,
            add_generation_prompt=True, tokenize=False, **renderer.apply_chat_template_kwargs,
        )
    except Exception as exc:
        if raised_by_template(exc):
            return False
        raise
    return True


def special_tokens(tokenizer: Any) -> tuple[tuple[str, ...], frozenset[int]]:
    """Special tokens of ``tokenizer`` (named ones and added tokens marked special) whose text
    encodes to one id, longest first, and those ids."""
    names = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names.update(str(tok) for tok in decoder.values() if getattr(tok, "special", False))
    texts, ids = [], set()
    for name in sorted(filter(None, names), key=lambda t: (-len(t), t)):
        token_id = tokenizer.convert_tokens_to_ids(name) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        is_unk = token_id == getattr(tokenizer, "unk_token_id", None) and name != getattr(tokenizer, "unk_token", None)
        if isinstance(token_id, int) and token_id >= 0 and not is_unk:
            texts.append(name)
            ids.add(token_id)
    return tuple(texts), frozenset(ids)


def _tool_names(tools: Sequence[Any]) -> str:
    """``[calculator, search]`` from OpenAI function schemas (``?`` for one without a name)."""
    names = []
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        names.append(str(spec.get("name", "?")) if isinstance(spec, Mapping) else "?")
    return "[" + ", ".join(names) + "]"
