"""The control credential: who may change or read the trainer's state on an agentloop server.

Two kinds of client reach an engine server or a gateway. Chat clients (agents, people,
``EngineHTTPClient.generate``) hold the ``api_key`` and use the chat routes. The trainer also
changes the engine (``/update_weights``, ``/sleep``, ``/wake_up``, ``/abort``) and administers
the gateway's sessions (``GET /sessions``, ``POST``/``GET``/``DELETE /sessions/<id>``): those
are control routes, and they take a second key, the ``control_key``, which chat clients never
get. An agent's tool code holds the chat key (or no key at all on a loopback server), so a
chat key that opened control routes would let it replace the policy or pause the engine.

The routes are told apart by an allow-list of chat paths (:func:`is_chat_path`): any other
path is a control route, so a route added later is closed until it is listed here. An app built
without a control key answers every control route 403; the in-process threads
(:class:`~agentloop_engines.serving.server.ServerThread`,
:class:`~agentloop_engines.serving.gateway.GatewayThread`) make one with :func:`new_control_key` and
hand it to the code that started them (``thread.control_key``).
"""

from __future__ import annotations

import re
import secrets

from agentloop_engines.wire.routes import FORGET_SESSION_PATH

__all__ = ["CHAT_PATHS", "check_control_key", "is_chat_path", "new_control_key"]

_V1 = r"/v1/(?:chat/completions|completions|models|responses|messages|messages/count_tokens)"
CHAT_PATHS = re.compile(rf"/generate|{re.escape(FORGET_SESSION_PATH)}|{_V1}|/sessions/[^/]+(?:/[^/]+)?{_V1}")
"""The chat routes (full match on the request path): ``/generate`` and ``/forget_session`` (the
hint that a trajectory generated with an id is over: it drops an engine cache entry and changes
no output), the ``/v1`` routes (OpenAI's chat and text completions, models and Responses;
Anthropic's Messages and its token count), and the same under a session's base URL
(``/sessions/<id>/<session key>/v1``; the form without a key is listed so that it gets its own
404 saying the key is missing)."""


def is_chat_path(path: str) -> bool:
    """Whether ``path`` is a chat route (the ``api_key``'s); every other guarded path is control."""
    return CHAT_PATHS.fullmatch(path) is not None


def new_control_key() -> str:
    """A fresh random control key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def check_control_key(control_key: str | None, api_key: str | None) -> None:
    """Refuse a control key that would not separate control from chat.

    Raises:
        ValueError: on an empty key, one with whitespace, or one equal to ``api_key`` (every
            chat client would hold it).
    """
    if control_key is None:
        return
    if not isinstance(control_key, str) or not control_key or any(c.isspace() for c in control_key):
        raise ValueError("control_key must be a non-empty string without whitespace; pass None to turn the control "
                         "routes off, or agentloop_engines.serving.control.new_control_key()")
    if api_key is not None and secrets.compare_digest(control_key.encode(), api_key.encode()):
        raise ValueError("control_key equals api_key, so every chat client would hold it; use a key of its own "
                         "(agentloop_engines.serving.control.new_control_key())")
