"""What the tool loops work out once per tokenizer and reuse for every sample: the ids of the
tool parser's stop tokens, the longest token's length in characters (the token-budgeted
truncation's window), and whether the chat template renders ``tools=`` (core's
:func:`~agentloop_core.tokenization.renders_tools`, which the trainer and the gateway ask too).

A loop object is built per sample (4096 concurrent trajectories build 4096 loops), and
``tokenizer.get_vocab()`` builds a fresh dict of the whole vocabulary each call: done per sample
it was ~3% of the framework's time at that scale (``bench/bench_scale.py``).

The cache holds its tokenizer weakly (``weakref.WeakKeyDictionary``): an entry goes away with
its tokenizer, and a new tokenizer allocated where a freed one lived can never hit the old
entry, as it could when entries were keyed by ``id()``. A tokenizer that cannot be weakly
referenced or hashed is not cached; its answers are worked out each time.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["check_template_renders_tools", "longest_token_chars", "stop_token_ids"]

logger = logging.getLogger(__name__)

_Entry = TypeVar("_Entry")

_STOP_TOKEN_IDS: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], tuple[int, ...]]] = weakref.WeakKeyDictionary()
_LONGEST_TOKEN: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _entry(cache: weakref.WeakKeyDictionary[Any, _Entry], owner: Any, make: Callable[[], _Entry]) -> _Entry:
    """``owner``'s entry in ``cache`` (created with ``make``), or a fresh unshared one when
    ``owner`` cannot be a weak key."""
    try:
        entry = cache.get(owner)
        if entry is None:
            entry = cache[owner] = make()
        return entry
    except TypeError:  # no __weakref__ slot, or unhashable
        return make()


def stop_token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of ``tokens`` (a tool parser's ``stop_tokens``) in ``tokenizer``'s vocabulary,
    in order; tokens the vocabulary lacks are left out (EOS still ends the turn).

    Worked out once per tokenizer and token tuple: a vocabulary does not change during a
    rollout.
    """
    tokens = tuple(tokens)
    known = _entry(_STOP_TOKEN_IDS, tokenizer, dict)
    ids = known.get(tokens)
    if ids is None:
        vocab = tokenizer.get_vocab()
        for token in tokens:
            if token not in vocab:
                # A llama3 parser over a non-llama tokenizer: EOS still ends the turn.
                logger.debug("tool parser stop token %r is not in the tokenizer's vocabulary", token)
        ids = known[tokens] = tuple(vocab[t] for t in tokens if t in vocab)
    return ids


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` can stand for (at least 1).

    Measured on the vocabulary's token strings, added tokens included. A byte-level token's
    string has one character per byte and SentencePiece's ``\u2581`` stands for one space, so
    this is an upper bound on the text characters a token covers: a text of ``n * bound + 1``
    characters takes more than ``n`` tokens. Worked out once per tokenizer.
    """
    known = _entry(_LONGEST_TOKEN, tokenizer, list)
    if not known:
        known.append(max((len(t) for t in tokenizer.get_vocab()), default=1) or 1)
    return known[0]


def check_template_renders_tools(renderer: Any, names: list[str], loop_name: str = "tool_agent") -> None:
    """Fail before any rollout when the chat template ignores ``tools=``: the model would never
    see the tool schemas, and every trajectory would be wasted compute.

    Asked once per tokenizer (``renderer.processor``), template and template variables
    (:func:`agentloop_core.tokenization.renders_tools` caches the answer).

    Args:
        renderer: The loop's ``ChatRenderer``, built with the tool schemas.
        names: The loop's tool names, for the message.
        loop_name: The loop, for the message.

    Raises:
        ValueError: naming the tools and the fix.
    """
    from agentloop_core.tokenization import renders_tools

    if renders_tools(renderer.processor, chat_template=renderer.chat_template,
                     apply_chat_template_kwargs=renderer.apply_chat_template_kwargs):
        return
    raise ValueError(
        f"{loop_name} has tools {names} but the chat template ignores tools= (rendering with and without "
        "them gives the same text), so the model would never see the tool schemas. Use a tool-aware "
        "template: with the trainer set model.custom_chat_template=chatml-hermes (a built-in; or a path to "
        "a Jinja file); in your own code pass ChatRenderer(chat_template=...) or set tokenizer.chat_template, "
        "e.g. to agentloop_core.tokenization.resolve_chat_template('chatml-hermes')"
    )
