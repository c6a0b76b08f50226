"""Secret redaction for traces: which keys hold credentials (:func:`is_secret_key`), masking
them in values and text (:func:`redact`, :func:`redact_text`), and the scope that lets a nested
span mask the secrets of the spans around it (:func:`span_secrets`, :func:`redact_span`)."""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "REDACTED",
    "is_secret_key",
    "redact",
    "redact_span",
    "redact_text",
    "span_known_secrets",
    "span_secrets",
]

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
    ``Authorization``, ``hf_token``, ``client_secret``, an agentloop server's ``control_key`` or
    ``session_key``...), so its value must not be written."""
    parts = _key_parts(key)
    if not parts:
        return False
    if any(p in _SECRET_PARTS for p in parts):
        return True
    for a, b in zip(parts, parts[1:], strict=False):
        if b == "key" and a in {"api", "access", "secret", "private", "auth", "control", "session"}:
            return True
    if parts[-1] == "token":
        return len(parts) == 1 or parts[-2] not in _VOCAB_TOKEN_PREFIXES
    return False


# Keys that are secrets in a query string or ``key=value`` text though not as attribute names
# ("key" alone is too common a dict key to redact everywhere).
_TEXT_SECRET_KEYS = frozenset({"key", "sig", "signature", "pass", "pwd"})
# scheme://userinfo@host: the whole userinfo goes (a user name is often a key id, e.g. AWS).
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][\w+.-]*://)(?P<userinfo>[^/\s@?#'\"]+)@")
# name=value and name: value, with the name optionally quoted (JSON, Python reprs, headers). The
# name and the value are matched apart so that a value that swallows the next pair
# ("model=m?api_key=...") cannot hide it.
_NAME_SEP = re.compile(r"""(?P<name>[A-Za-z_][\w.-]*)["']?\s*[=:]\s*""")
_VALUE = re.compile(r"""(?:bearer|basic|token)\s+[^\s&,;"'}\]]+|"[^"]*"|'[^']*'|[^\s&,;"'}\]#?]+""", re.IGNORECASE)
_BEARER = re.compile(r"\b(?P<scheme>bearer|basic)\s+(?P<value>[^\s,;\"'}\]]+)", re.IGNORECASE)


def _secret_in_text(name: str) -> bool:
    return is_secret_key(name) or name.lower() in _TEXT_SECRET_KEYS


def _mask_pairs(text: str) -> str:
    out, pos = [], 0
    for m in _NAME_SEP.finditer(text):
        if m.start() < pos or not _secret_in_text(m["name"]):
            continue
        value = _VALUE.match(text, m.end())
        if value is None:
            continue
        quote = value[0][0] if value[0][0] in "\"'" and len(value[0]) > 1 else ""
        out += [text[pos:m.end()], quote, REDACTED, quote]
        pos = value.end()
    out.append(text[pos:])
    return "".join(out)


def redact_text(text: str, known: frozenset[str] = frozenset()) -> str:
    """``text`` with credentials masked: ``scheme://user:pass@`` userinfo, values of secret-looking
    ``name=value`` / ``name: value`` pairs (query strings, headers, JSON, reprs), ``Bearer``/``Basic``
    credentials, and every occurrence of the ``known`` secret values."""
    for secret in sorted(known, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    text = _BEARER.sub(lambda m: f"{m['scheme']} {REDACTED}", text)
    return _mask_pairs(text)


def _known_secrets(value: Any, out: set[str]) -> frozenset[str]:
    """String values (4 characters or more) held under secret-looking keys, anywhere in
    ``value``, added to ``out``: an exception message or a log line in the same record that
    repeats one is masked too."""
    _collect_secrets(value, out)
    return frozenset(s for s in out if len(s) >= 4)


def _collect_secrets(value: Any, out: set[str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if is_secret_key(k) and isinstance(v, str) and len(v) >= 4:
                out.add(v)
                if v[:7].lower() == "bearer ":
                    out.add(v[7:].strip())
            else:
                _collect_secrets(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_secrets(v, out)


def redact(value: Any, known: frozenset[str] | None = None) -> Any:
    """Copy ``value`` with every secret-looking mapping key's value replaced by ``[REDACTED]``
    and every string passed through :func:`redact_text` (credentials in URLs, query strings,
    ``Bearer`` headers, exception messages), recursing into dicts, lists and tuples. Values seen
    under secret keys are masked wherever else they appear in ``value``."""
    if known is None:
        known = _known_secrets(value, set())
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_key(k) else redact(v, known)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, known) for v in value)
    if isinstance(value, str):
        if value[:7].lower() == "bearer ":
            return REDACTED
        return redact_text(value, known)
    return value


# Secret values seen under secret keys in the spans open around this one: a nested span's error
# text that repeats one (an API key in an exception message) is masked although its own record
# does not say it is a secret.
_SPAN_SECRETS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "agentloop_span_secrets", default=frozenset()
)


@contextmanager
def span_secrets(record: dict[str, Any]) -> Iterator[None]:
    """Make the secret values of ``record`` (an opening span's attributes) known to
    :func:`redact_span` in the spans opened inside."""
    token = _SPAN_SECRETS.set(_SPAN_SECRETS.get() | _known_secrets(record, set()))
    try:
        yield
    finally:
        _SPAN_SECRETS.reset(token)


def span_known_secrets(record: dict[str, Any]) -> frozenset[str]:
    """The secret values of ``record`` and of the spans open around it."""
    return _known_secrets(record, set(_SPAN_SECRETS.get()))


def redact_span(record: dict[str, Any]) -> dict[str, Any]:
    """:func:`redact` for a span record, also masking the secrets of the spans around it."""
    return redact(record, span_known_secrets(record))
