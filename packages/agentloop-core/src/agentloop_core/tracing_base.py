"""The tracer interface, the no-op tracer, trace tags and secret redaction: what the tracing
backends (:mod:`agentloop_core.tracing_jsonl`, :mod:`agentloop_core.tracing_mlflow`) build on.
:mod:`agentloop_core.tracing` re-exports it and picks a backend (:func:`make_tracer`), so the
backends never import the module that imports them."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Never mutated in place (trace_context sets a new dict), so a shared empty default is safe.
_TRACE_TAGS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "agentloop_trace_tags", default={}  # noqa: B039
)


@contextmanager
def trace_context(**tags: Any) -> Iterator[None]:
    """Tag every span opened inside (this asyncio task and its children) with ``tags``,
    e.g. ``step``, ``sample_index``, ``rollout_n``."""
    token = _TRACE_TAGS.set({**_TRACE_TAGS.get(), **tags})
    try:
        yield
    finally:
        _TRACE_TAGS.reset(token)


def current_tags() -> dict[str, Any]:
    return dict(_TRACE_TAGS.get())


class Tracer:
    """Base tracer: times spans and hands finished ones to :meth:`emit`."""

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time a block. The yielded dict can be filled with more attributes inside the block."""
        record: dict[str, Any] = {"name": name, **current_tags(), **attributes}
        start_wall = time.time()
        start = time.perf_counter()
        try:
            yield record
        except BaseException as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record["start_time"] = start_wall
            record["duration_s"] = time.perf_counter() - start
            self.emit(record)

    def emit(self, record: dict[str, Any]) -> None:
        """Store one finished span."""

    def flush(self) -> None:
        """Write buffered spans."""

    def close(self) -> None:
        self.flush()


class NullTracer(Tracer):
    """Times nothing, stores nothing."""

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        yield {}


# --- secrets -------------------------------------------------------------------------------

REDACTED = "[REDACTED]"

# Key parts that always mark a secret. "token" is handled separately because most keys with
# "token" in them are counts or ids (max_tokens, prompt_token_ids), not credentials.
_SECRET_PARTS = frozenset(
    {"authorization", "auth", "password", "passwd", "secret", "apikey", "cookie", "credential", "credentials", "bearer"}
)
# A key ending in "token" is a credential unless the word before says it is a vocabulary token.
_VOCAB_TOKEN_PREFIXES = frozenset({"eos", "bos", "pad", "unk", "sep", "cls", "mask", "stop", "special", "max", "num"})


def _key_parts(key: str) -> list[str]:
    out: list[str] = []
    word = ""
    for ch in str(key):
        if ch.isalnum():
            # camelCase boundary: apiKey -> api, key
            if ch.isupper() and word and word[-1].islower():
                out.append(word.lower())
                word = ""
            word += ch
        elif word:
            out.append(word.lower())
            word = ""
    if word:
        out.append(word.lower())
    return out


def is_secret_key(key: str) -> bool:
    """True when an attribute key looks like it holds a credential (``api_key``,
    ``Authorization``, ``hf_token``, ``client_secret``...), so its value must not be written."""
    parts = _key_parts(key)
    if not parts:
        return False
    if any(p in _SECRET_PARTS for p in parts):
        return True
    for a, b in zip(parts, parts[1:], strict=False):
        if b == "key" and a in {"api", "access", "secret", "private", "auth"}:
            return True
    if parts[-1] == "token":
        return len(parts) == 1 or parts[-2] not in _VOCAB_TOKEN_PREFIXES
    return False


def redact(value: Any) -> Any:
    """Copy ``value`` with every secret-looking mapping key's value replaced by ``[REDACTED]``
    and every ``Bearer ...`` string masked, recursing into dicts, lists and tuples."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_key(k) else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str) and value[:7].lower() == "bearer ":
        return REDACTED
    return value
