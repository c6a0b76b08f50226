"""One generation of the gateway: the engine's output cut at the first text ``stop`` string.

The engine stops on ids (EOS, ``stop_token_ids``, ``max_tokens``); a text stop string can end
inside a token or span several, so the gateway searches the decoded ids
(:func:`~agentloop_engines.serving.gateway.stop.find_stop`), keeps the ids up to the token completing
the first match and reports how many it dropped. What is kept is what the session records and
what the response's ``token_ids`` say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import TokenOutput
from agentloop_core.vision import ImageItem
from agentloop_engines.serving.gateway.stop import find_stop

__all__ = ["FINISH_REASONS", "Generation", "cut_at_stop"]

FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}
"""The OpenAI ``finish_reason`` of each engine ``stop_reason`` (a chat answer with tool calls
that ended its turn says ``tool_calls`` instead; one cut at ``max_tokens`` stays ``length``)."""


@dataclass(frozen=True)
class Generation:
    """What one engine call generated, as the gateway answers and records it."""

    prompt_ids: list[int]
    """The prompt the engine was given."""
    token_ids: list[int]
    """The generated ids, up to the token completing the first stop string."""
    log_probs: list[float] | None
    """Their log-probs (None when the engine returned none)."""
    stop_reason: str
    """The engine's ``stop_reason``; ``"stop"`` when a stop string ended it (unless aborted)."""
    text: str
    """The decoded response text, without the stop string."""
    stop: str | None
    """The stop string that ended the generation; None when none did (EOS, a stop token, length)."""
    dropped: int
    """Ids the engine generated past the stop string, cut."""
    extra: dict[str, Any]
    """The engine output's ``extra``."""
    images: tuple[ImageItem, ...] = ()
    """The images of the prompt."""


def cut_at_stop(out: TokenOutput, prompt_ids: Sequence[int], stops: Sequence[str],
                text: Callable[[Sequence[int]], str], images: Sequence[ImageItem] = ()) -> Generation:
    """``out`` cut at the first of ``stops`` found in its decoded ids (``text`` decodes ids as
    the response shows them). The search decodes prefixes: run it off the event loop."""
    ids = list(out.token_ids)
    log_probs = None if out.log_probs is None else list(out.log_probs)
    stop_reason = out.stop_reason
    match = find_stop(ids, text, stops) if stops else None
    dropped = 0
    if match is not None:
        dropped = len(ids) - match.keep
        ids = ids[: match.keep]
        log_probs = None if log_probs is None else log_probs[: match.keep]
        if stop_reason != "aborted":
            stop_reason = "stop"
    return Generation(prompt_ids=list(prompt_ids), token_ids=ids, log_probs=log_probs, stop_reason=stop_reason,
                      text=match.text if match is not None else text(ids), stop=None if match is None else match.stop,
                      dropped=dropped, extra=dict(out.extra), images=tuple(images))
