"""Per-session recording of the calls a black-box agent makes through the gateway.

A session is one trajectory: every call made under ``/sessions/<session_id>/v1/...`` is kept,
with the exact prompt ids the engine saw, the ids it generated and their log-probs, until the
loop takes the recording with :meth:`SessionRecorder.pop`. Nothing here does I/O.

A session is reachable over HTTP only with its session key, a random secret made when it is
opened and carried in its URL (``/sessions/<id>/<session key>/v1``), so knowing a session's id
(a row index, a log line) is not enough to call in it; and its sampling overrides and response
budget are set once, by whoever opened it (opening an open session is refused).

Sessions are bounded, so an agent that never finishes (or a loop that forgets to pop) cannot
grow memory without bound: a session idle for ``ttl_s`` is dropped, the least recently used
session is dropped when ``max_sessions`` are open, and a session takes at most
``max_calls_per_session`` calls. Asking for a dropped session says which limit dropped it.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cachetools import LRUCache

from agentloop_core.protocol import StopReason

logger = logging.getLogger(__name__)

__all__ = [
    "RecordedCall",
    "SessionCallLimitError",
    "SessionExistsError",
    "SessionNotFoundError",
    "SessionRecorder",
    "check_session_id",
]

_SESSION_ID = re.compile(r"[A-Za-z0-9._:~-]{1,200}")


def check_session_id(session_id: str) -> str:
    """Return ``session_id`` if it can be a URL path segment and a request id.

    Raises:
        ValueError: on an empty id, one over 200 characters, or one with characters other than
            letters, digits and ``. _ : ~ -``.
    """
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise ValueError(f"invalid session id {session_id!r}: use 1-200 letters, digits or . _ : ~ - "
                         "(it is a URL path segment and the engine request id)")
    return session_id


@dataclass(frozen=True)
class RecordedCall:
    """One completion served in a session: exactly what the engine saw and generated."""

    index: int
    """Position in the session, from 0, in the order the calls finished."""
    endpoint: str
    """``chat.completions`` or ``completions``."""
    prompt_ids: list[int]
    """The prompt token ids sent to the engine."""
    token_ids: list[int]
    """The generated ids kept: what the engine generated, cut right after the token that
    completed a text ``stop`` string (so always a prefix of what it sampled)."""
    log_probs: list[float] | None
    """The engine's log-prob of each id in ``token_ids``, or None when it returned none."""
    stop_reason: StopReason
    """``stop`` (a stop token, EOS or a text stop string), ``length`` or ``aborted``."""
    finish_reason: str
    """What the response said: ``stop``, ``length``, ``tool_calls`` or ``abort``."""
    request: dict[str, Any]
    """The request body as received (messages, tools, sampling), for debugging; each image URL
    replaced by its digest and length (the images themselves are :attr:`images`)."""
    response: dict[str, Any]
    """The response body (non-streaming form, streamed calls included), for debugging."""
    dropped_after_stop: int = 0
    """Tokens the engine sampled after the token that completed a stop string, not kept."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The engine output's ``extra`` (``replica``: the replica that served it, behind an
    ``LLMServerClient``); for chat calls also ``extends_previous``: whether the prompt is the
    previous chat call's prompt + generated ids + the template's delta for the messages the
    agent appended (False: the request was rendered whole, so the call starts a new segment
    unless its re-encoded history happens to match)."""
    created: float = 0.0
    """Unix time the call finished."""
    images: tuple[Any, ...] = ()
    """The :class:`~agentloop_core.vision.ImageItem` s of ``prompt_ids``, in the order of their
    tokens (what ``generate`` was given as ``multi_modal_data``); empty for a text prompt."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``GET /sessions/<id>`` returns per call); each image as its
        digest, size and token count."""
        out = asdict(replace(self, images=()))
        out["images"] = [{"digest": item.digest, "size": list(getattr(item.image, "size", ())),
                          "num_tokens": item.num_tokens} for item in self.images]
        return out


class SessionNotFoundError(KeyError):
    """No recording for the session: never used, already taken, or dropped by a limit."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class SessionExistsError(ValueError):
    """The session is already open: its overrides and budget were fixed by whoever opened it."""


class SessionCallLimitError(ValueError):
    """The session already holds ``max_calls_per_session`` calls."""


class SessionBudgetError(ValueError):
    """The session's current segment has used its response budget (``response_length``)."""


@dataclass
class _Session:
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    calls: list[RecordedCall] = field(default_factory=list)
    last_used: float = 0.0
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    chat_state: Any = None
    api_state: dict[str, Any] = field(default_factory=dict)
    response_length: int | None = None
    segment_prompt_len: int = 0
    exhausted: bool = False


def _extends(session: _Session, prompt_ids: list[int]) -> bool:
    """Whether ``prompt_ids`` continues the session's last call (its prompt + generated ids)."""
    if not session.calls:
        return False
    last = session.calls[-1]
    n = len(last.prompt_ids) + len(last.token_ids)
    return len(prompt_ids) >= n and prompt_ids[: len(last.prompt_ids)] == last.prompt_ids and \
        prompt_ids[len(last.prompt_ids) : n] == last.token_ids


class SessionRecorder:
    """Recordings by session id, bounded in count, idle time and calls per session. Thread-safe
    (the gateway records on its server's event loop; the loop that owns a trajectory pops from
    its own).

    Args:
        max_sessions: Most sessions held; opening one more drops the least recently used.
        ttl_s: A session not used (no call, no open) for this long is dropped. None: never.
        max_calls_per_session: Calls beyond this are refused (:class:`SessionCallLimitError`)
            before anything is generated.
        clock: Monotonic seconds (tests pass a fake one).

    Raises:
        ValueError: on a limit below 1 or a non-positive ``ttl_s``.
    """

    def __init__(self, *, max_sessions: int = 10_000, ttl_s: float | None = 3600.0,
                 max_calls_per_session: int = 1000, clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1 or max_calls_per_session < 1:
            raise ValueError(f"max_sessions and max_calls_per_session must be >= 1, got {max_sessions} "
                             f"and {max_calls_per_session}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None (never expire), got {ttl_s}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_calls_per_session = max_calls_per_session
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        # Why recently dropped sessions went, so a late pop can say so (bounded like the rest).
        self._dropped: LRUCache[str, str] = LRUCache(maxsize=max(1024, max_sessions))
        self._lock = threading.Lock()
        self.evicted = 0
        """Sessions dropped because ``max_sessions`` were open (monotonic)."""
        self.expired = 0
        """Sessions dropped after ``ttl_s`` idle (monotonic)."""

    # ---- the loop's side -----------------------------------------------------------------

    def open(self, session_id: str, *, sampling_overrides: Mapping[str, Any] | None = None,
             response_length: int | None = None) -> str:
        """Start a session, so :meth:`pop` returns ``[]`` if the agent makes no call.

        Args:
            session_id: The trajectory's id (see :func:`check_session_id`).
            sampling_overrides: Sampling parameters that replace what the agent's requests ask
                for in this session (the trainer's temperature, a per-turn ``max_tokens``).
            response_length: Response tokens one training segment may hold (the rollout's
                ``response_length``, the trainer's ``data.max_response_length``): calls are capped to what is left of it, and a call with
                nothing left is refused (:class:`SessionBudgetError`). None: no budget.

        Returns:
            The session key: what a call over HTTP must carry (see :meth:`key`).

        Raises:
            SessionExistsError: when the session is open already (its settings stay as they are).
        """
        check_session_id(session_id)
        if response_length is not None and (isinstance(response_length, bool) or not isinstance(response_length, int)
                                            or response_length < 1):
            raise ValueError(f"response_length must be an integer >= 1 or None, got {response_length!r}")
        with self._lock:
            self._expire()
            if session_id in self._sessions:
                raise SessionExistsError(
                    f"session {session_id!r} is already open: its sampling overrides and response budget were fixed "
                    "by whoever opened it and cannot be changed; take it first (DELETE /sessions/<id>, or "
                    "close_session) to open it anew")
            session = self._touch(session_id)
            session.sampling_overrides = dict(sampling_overrides or {})
            session.response_length = response_length
            return session.key

    def key(self, session_id: str, *, create: bool = False) -> str:
        """The session key of an open session: its URL is ``/sessions/<id>/<key>/v1``.

        Args:
            session_id: The session.
            create: Open the session (no overrides, no budget) when it is not open.

        Raises:
            SessionNotFoundError: when the session is not open and ``create`` is False.
        """
        check_session_id(session_id)
        with self._lock:
            self._expire()
            session = self._sessions.get(session_id)
            if session is None:
                if not create:
                    raise SessionNotFoundError(self._missing(session_id))
                session = self._touch(session_id)
            return session.key

    def authorize(self, session_id: str, key: str) -> None:
        """Check that ``key`` is the key of ``session_id``, an open session (in constant time).

        Raises:
            SessionNotFoundError: the same for a wrong key and a session that is not open, so a
                caller without the key learns nothing about the session.
        """
        with self._lock:
            self._expire()
            self._authorized(session_id, key)

    def _authorized(self, session_id: str, key: str) -> _Session:
        session = self._sessions.get(session_id)
        # Compared even when there is no session, so a miss takes as long as a wrong key.
        expected = session.key if session is not None else secrets.token_urlsafe(24)
        if not (isinstance(key, str) and hmac.compare_digest(key.encode(), expected.encode())) or session is None:
            raise SessionNotFoundError(
                f"no open session {session_id!r} with this session key: a session's URL "
                "(/sessions/<id>/<session key>/v1) comes from whoever opened it (POST /sessions/<id> with the "
                "control key, or GatewayThread.session_url), and stops working once the session is taken or "
                f"dropped (ttl_s={self.ttl_s}s idle, max_sessions={self.max_sessions})")
        return session

    def remaining_budget(self, session_id: str, prompt_ids: list[int]) -> int | None:
        """Response tokens a call with ``prompt_ids`` may still generate in its segment: the
        budget minus what the segment holds after its first prompt (a call whose prompt extends
        the last call's prompt + generation continues the segment, as in
        :class:`~agentloop_core.segments.SegmentBuilder`; any other starts a new one). None
        without a budget. A call with nothing left marks the session :meth:`exhausted`."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.response_length is None:
                return None
            used = len(prompt_ids) - session.segment_prompt_len if _extends(session, prompt_ids) else 0
            left = session.response_length - used
            if left < 1:
                session.exhausted = True
            return left

    def exhausted(self, session_id: str) -> bool:
        """Whether a call of the session was refused for want of response budget."""
        with self._lock:
            session = self._sessions.get(session_id)
            return session is not None and session.exhausted

    def get(self, session_id: str) -> list[RecordedCall]:
        """The session's calls so far, in order (the session stays).

        Raises:
            SessionNotFoundError: saying whether it expired, was evicted or never existed.
        """
        with self._lock:
            self._expire()
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFoundError(self._missing(session_id))
            return list(session.calls)

    def pop(self, session_id: str) -> list[RecordedCall]:
        """Take the session's calls, in order, and forget the session.

        Pop once the agent is done: a call still in flight then is recorded in a new session of
        the same id (dropped after ``ttl_s`` if nobody takes it).

        Raises:
            SessionNotFoundError: saying whether it expired, was evicted or never existed.
        """
        with self._lock:
            self._expire()
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionNotFoundError(self._missing(session_id))
            self._dropped[session_id] = "was already taken with pop() or DELETE"
            return session.calls

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            self._expire()
            return session_id in self._sessions

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._sessions)

    def session_ids(self) -> list[str]:
        """Open sessions, least recently used first."""
        with self._lock:
            self._expire()
            return list(self._sessions)

    # ---- the gateway's side --------------------------------------------------------------

    def begin(self, session_id: str, *, key: str | None = None) -> dict[str, Any]:
        """Called before generating in a session: checks its key and its call limit.

        Args:
            session_id: The session.
            key: The session key the call carried (an HTTP call); the session must be open and
                this its key. None: a call made in-process by code that holds the gateway, which
                opens the session if needed.

        Returns:
            The session's sampling overrides.

        Raises:
            SessionNotFoundError: with ``key``, when the session is not open or the key is not its.
            SessionCallLimitError: when the session already holds ``max_calls_per_session`` calls.
        """
        with self._lock:
            if key is None:
                session = self._touch(session_id)
            else:
                self._expire()
                self._authorized(session_id, key)
                session = self._touch(session_id)
            if len(session.calls) >= self.max_calls_per_session:
                raise SessionCallLimitError(
                    f"session {session_id!r} already holds {len(session.calls)} calls "
                    f"(max_calls_per_session={self.max_calls_per_session}); a session is one trajectory, "
                    "so an agent making this many calls is likely stuck in a loop")
            return dict(session.sampling_overrides)

    def record(self, session_id: str, call: RecordedCall) -> RecordedCall:
        """Append ``call`` to the session (renumbered to its position) and return it."""
        with self._lock:
            session = self._touch(session_id)
            if not _extends(session, call.prompt_ids):
                session.segment_prompt_len = len(call.prompt_ids)
            call = _renumber(call, len(session.calls))
            session.calls.append(call)
            return call

    def chat_state(self, session_id: str) -> Any:
        """What the gateway keeps to continue the session's last chat call token-exactly
        (see :mod:`~agentloop_engines.serving.gateway.continuation`); None for a session without one or
        no session. It goes with the session (pop, expiry, eviction)."""
        with self._lock:
            session = self._sessions.get(session_id)
            return None if session is None else session.chat_state

    def set_chat_state(self, session_id: str, state: Any) -> None:
        """Keep ``state`` for the session's next chat call (nothing when the session is gone)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.chat_state = state

    def api_state(self, session_id: str) -> dict[str, Any]:
        """A mutable dict that goes with the session (pop, expiry, eviction): what an API
        translator keeps between its calls, such as the Responses API's stored responses. A
        session that is not open gets a new empty dict, kept nowhere."""
        with self._lock:
            session = self._sessions.get(session_id)
            return {} if session is None else session.api_state

    # ---- bounds --------------------------------------------------------------------------

    def _touch(self, session_id: str) -> _Session:
        self._expire()
        now = self._clock()
        session = self._sessions.get(session_id)
        if session is None:
            while len(self._sessions) >= self.max_sessions:
                old, _ = self._sessions.popitem(last=False)
                self._dropped[old] = (f"was evicted as the least recently used of max_sessions="
                                      f"{self.max_sessions} open sessions")
                self.evicted += 1
                logger.warning("session %r evicted: max_sessions=%d are open (pop finished sessions, "
                               "or raise max_sessions)", old, self.max_sessions)
            session = self._sessions[session_id] = _Session()
            self._dropped.pop(session_id, None)
        session.last_used = now
        self._sessions.move_to_end(session_id)
        return session

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        deadline = self._clock() - self.ttl_s
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if session.last_used > deadline:
                break
            del self._sessions[session_id]
            self._dropped[session_id] = f"expired after ttl_s={self.ttl_s}s without a call"
            self.expired += 1

    def _missing(self, session_id: str) -> str:
        why = self._dropped.get(session_id)
        if why is not None:
            return f"session {session_id!r} {why}"
        return (f"no session {session_id!r}: it was never opened and made no call (sessions are "
                f"dropped after ttl_s={self.ttl_s}s idle or when max_sessions={self.max_sessions} "
                "are open)")


def _renumber(call: RecordedCall, index: int) -> RecordedCall:
    return call if call.index == index else replace(call, index=index)
