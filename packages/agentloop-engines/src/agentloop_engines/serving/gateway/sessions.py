"""Session bookkeeping of the :class:`~agentloop_engines.serving.gateway.core.Gateway`.

A session is one trajectory's calls: opened by the rollout (``open_session``), its key carried
by every HTTP call (:meth:`GatewaySessions._authorize`), each call admitted with the session's
sampling overrides and what is left of its response budget (:meth:`GatewaySessions._admit`),
recorded with its exact ids (:meth:`GatewaySessions._record`), and taken back whole when the
rollout closes it (``close_session``), which also frees its sticky-routing slot in the server
and its decoded images. The recording itself is
:class:`~agentloop_engines.serving.gateway.recorder.SessionRecorder`'s; this is the gateway's side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from agentloop_core.protocol import SamplingParams
from agentloop_engines.serving.gateway.generation import Generation
from agentloop_engines.serving.gateway.images import GatewayImages, recorded_request
from agentloop_engines.serving.gateway.recorder import (
    RecordedCall,
    SessionBudgetError,
    SessionRecorder,
    check_session_id,
)

__all__ = ["GatewaySessions"]


class GatewaySessions:
    """The session half of :class:`~agentloop_engines.serving.gateway.core.Gateway`, its base class:
    the attributes below are the gateway's."""

    server: Any
    server_loop: asyncio.AbstractEventLoop | None
    recorder: SessionRecorder
    images: GatewayImages

    def open_session(self, session_id: str, *, sampling_overrides: Mapping[str, Any] | None = None,
                     response_length: int | None = None) -> str:
        """Start recording ``session_id`` (see :meth:`SessionRecorder.open`); return its session
        key, which its HTTP calls must carry (``GatewayThread.session_url`` builds the URL).

        Raises:
            ValueError: ``sampling_overrides`` with an unknown key or a value of the wrong type or
                range (see :class:`~agentloop_core.protocol.SamplingParams`), naming the key.
            SessionExistsError: when it is open already (its settings are fixed by its opener).
        """
        SamplingParams.from_mapping(sampling_overrides)
        return self.recorder.open(session_id, sampling_overrides=sampling_overrides, response_length=response_length)

    def close_session(self, session_id: str) -> list[RecordedCall]:
        """Take the session's recorded calls and free its sticky-routing slot in the server.

        Raises:
            SessionNotFoundError: saying whether it expired, was evicted or never existed.
        """
        calls = self.recorder.pop(session_id)
        if self.server.capabilities.forget_session:
            forget = self.server.forget_session
            if self.server_loop is not None and not self.server_loop.is_closed():
                self.server_loop.call_soon_threadsafe(forget, session_id)
            else:
                forget(session_id)
        self.images.forget(session_id)
        return calls

    def session_state(self, session_id: str) -> dict[str, Any]:
        """A mutable dict that lives as long as the open session ``session_id`` (closed, expired
        or evicted, it goes with it): what an API translator remembers between a session's calls,
        such as the Responses API's stored responses for ``previous_response_id``. A session
        that is not open gets a new empty dict, kept nowhere."""
        return self.recorder.api_state(session_id)

    def _authorize(self, session_id: str | None, session_key: str | None) -> None:
        # Before anything is parsed or rendered: a caller without the key gets nothing done.
        if session_key is not None:
            if session_id is None:
                raise ValueError("a session key without a session id; name the session in the URL")
            self.recorder.authorize(check_session_id(session_id), session_key)

    def _admit(self, session_id: str, session_key: str | None) -> dict[str, Any]:
        """Admit a call in its session (checked again here: the session may have been taken
        since it was authorized); return the session's sampling overrides."""
        check_session_id(session_id)
        return self.recorder.begin(session_id, key=session_key)

    def _cap_to_budget(self, session_id: str, prompt_ids: list[int], params: dict[str, Any]) -> None:
        """Lower ``params["max_tokens"]`` to what is left of the session's response budget.

        Raises:
            SessionBudgetError: when none is left.
        """
        left = self.recorder.remaining_budget(session_id, prompt_ids)
        if left is None:
            return
        if left < 1:
            raise SessionBudgetError(
                f"session {session_id!r}: this call's segment already holds its whole response budget "
                "(the trainer's response_length); the trajectory ends here")
        params["max_tokens"] = min(int(params.get("max_tokens") or left), left)

    def _record(self, endpoint: str, request: Mapping[str, Any], response: dict[str, Any], gen: Generation,
                session_id: str | None, extra: Mapping[str, Any] | None = None) -> RecordedCall | None:
        """Record the answered call in its session (adding ``session_id`` to the response);
        None outside a session."""
        if session_id is None:
            return None
        response["session_id"] = session_id
        return self.recorder.record(session_id, RecordedCall(
            index=0, endpoint=endpoint, prompt_ids=gen.prompt_ids, token_ids=gen.token_ids,
            log_probs=gen.log_probs, stop_reason=gen.stop_reason,  # type: ignore[arg-type]
            finish_reason=response["choices"][0]["finish_reason"], request=recorded_request(request),
            response=response, dropped_after_stop=gen.dropped, extra={**gen.extra, **(extra or {})},
            created=time.time(), images=gen.images))
