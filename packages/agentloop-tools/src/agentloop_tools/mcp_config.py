"""Settings of MCP servers (the ``mcpServers`` mapping), secret handling and the rate limiter.

Kept free of fastmcp imports, so configs validate without the ``mcp`` extra.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

__all__ = ["MCPServerConfig", "Secret", "TokenBucket", "parse_mcp_servers"]


class Secret:
    """A string that never shows itself in ``repr``/``str``; call :meth:`get` to use it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"secret values must be strings, got {type(value).__name__}")
        self._value = value

    def get(self) -> str:
        """The secret value."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __reduce__(self):  # pickling (e.g. to a Ray actor) keeps the value, just not in text
        return (Secret, (self._value,))


class TokenBucket:
    """Token-bucket rate limiter: on average ``rate`` acquisitions per second, at most ``burst``
    back to back. Shared by all tools of one server, across trajectories.

    Args:
        rate: Calls per second (> 0).
        burst: Bucket size (>= 1); 1 spaces every call by ``1 / rate`` seconds.
    """

    def __init__(self, rate: float, burst: int = 1) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate limit needs rate > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate = float(rate)
        self.burst = int(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        # A threading lock, not an asyncio one: tools may be shared by event loops in several threads.
        self._lock = threading.Lock()

    def _add(self, tokens: float) -> float:
        with self._lock:
            now = time.monotonic()
            # Refill up to the bucket size first: a refund must not lift a full bucket over it.
            self._tokens = min(self.burst, min(self.burst, self._tokens + (now - self._last) * self.rate) + tokens)
            self._last = now
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self) -> float:
        """Wait for a token. Returns the seconds waited. A caller cancelled while it waits gets
        its token back (:meth:`refund`), so calls that never ran do not slow down the rest."""
        wait = self._add(-1.0)
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                self.refund()
                raise
        return wait

    def refund(self) -> None:
        """Give back one token: for a call that acquired one but was cancelled before it
        reached the server."""
        self._add(1.0)


_SERVER_KEYS = {
    "url", "transport", "headers", "auth_token", "command", "args", "env", "cwd",
    "rate_limit", "rate_burst", "connect_retries", "retry_backoff_s", "timeout_s", "tool_selected_list",
    "max_result_bytes",
}

DEFAULT_MAX_RESULT_BYTES = 8 << 20
"""Most bytes one message from an MCP server may take on the wire (8 MiB: room for a few
screenshots as base64); more is dropped unread and the model reads an error naming the limit."""


@dataclass
class MCPServerConfig:
    """One entry of ``mcpServers``."""

    name: str
    """Server name (the key in ``mcpServers``)."""
    transport: Literal["http", "sse", "stdio"] = "http"
    """``http`` (streamable HTTP), ``sse``, or ``stdio`` (``command`` + ``args``)."""
    url: str | None = field(default=None, repr=False)  # may carry credentials; see display_url
    """Endpoint for http/sse, e.g. ``http://127.0.0.1:8000/mcp``."""
    headers: dict[str, Secret] = field(default_factory=dict)
    """Extra HTTP headers; values are secrets."""
    auth_token: Secret | None = None
    """Bearer token sent as ``Authorization: Bearer ...``."""
    command: str | None = None
    """Executable for stdio servers."""
    args: list[str] = field(default_factory=list)
    """Arguments for stdio servers."""
    env: dict[str, Secret] = field(default_factory=dict)
    """Environment for stdio servers; values are secrets."""
    cwd: str | None = None
    """Working directory for stdio servers."""
    rate_limit: float | None = None
    """Most calls per second to this server (token bucket); None means unlimited."""
    rate_burst: int = 1
    """Token-bucket size."""
    connect_retries: int = 5
    """Connection attempts before giving up (covers a server that is still starting)."""
    retry_backoff_s: float = 0.25
    """First retry delay; doubles each attempt, capped at 4 s."""
    timeout_s: float | None = 60.0
    """Per-request timeout."""
    tool_selected_list: list[str] | None = None
    """Only expose these remote tools (None: all)."""
    max_result_bytes: int | None = DEFAULT_MAX_RESULT_BYTES
    """Most bytes one message from the server may take, counted as they arrive, before anything
    is parsed (:mod:`agentloop_tools.mcp_limits`); a larger result is dropped unread and the
    model reads an error naming this key. None: no limit (the server is trusted)."""

    @property
    def display_url(self) -> str:
        """The URL without query string or credentials, safe to log."""
        if self.url is None:
            return f"stdio:{self.command}"
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, "", ""))

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> MCPServerConfig:
        """Validate one ``mcpServers`` entry.

        Raises:
            ValueError: Unknown keys, neither ``url`` nor ``command``, or a bad transport.
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"mcpServers[{name!r}] must be a mapping, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _SERVER_KEYS)
        if unknown:
            raise ValueError(f"mcpServers[{name!r}]: unknown keys {unknown}; known: {sorted(_SERVER_KEYS)}")
        has_url, has_cmd = raw.get("url") is not None, raw.get("command") is not None
        if has_url == has_cmd:
            raise ValueError(f"mcpServers[{name!r}] needs exactly one of 'url' (http/sse) or 'command' (stdio)")
        transport = raw.get("transport") or ("stdio" if has_cmd else "http")
        if transport == "streamable-http":
            transport = "http"
        if transport not in ("http", "sse", "stdio") or (transport == "stdio") != has_cmd:
            raise ValueError(
                f"mcpServers[{name!r}]: transport {transport!r} does not fit; use 'http' or 'sse' with "
                "'url', or 'stdio' with 'command'"
            )
        token = raw.get("auth_token")
        return cls(
            name=name,
            transport=transport,
            url=raw.get("url"),
            headers={str(k): v if isinstance(v, Secret) else Secret(str(v)) for k, v in (raw.get("headers") or {}).items()},
            auth_token=None if token is None else token if isinstance(token, Secret) else Secret(str(token)),
            command=raw.get("command"),
            args=[str(a) for a in raw.get("args") or []],
            env={str(k): v if isinstance(v, Secret) else Secret(str(v)) for k, v in (raw.get("env") or {}).items()},
            cwd=raw.get("cwd"),
            rate_limit=None if raw.get("rate_limit") is None else float(raw["rate_limit"]),
            rate_burst=int(raw.get("rate_burst", 1)),
            connect_retries=max(1, int(raw.get("connect_retries", 5))),
            retry_backoff_s=float(raw.get("retry_backoff_s", 0.25)),
            timeout_s=None if raw.get("timeout_s", 60.0) is None else float(raw.get("timeout_s", 60.0)),
            tool_selected_list=None if raw.get("tool_selected_list") is None else list(raw["tool_selected_list"]),
            max_result_bytes=_max_result_bytes(name, raw),
        )


def _max_result_bytes(name: str, raw: Mapping[str, Any]) -> int | None:
    value = raw.get("max_result_bytes", DEFAULT_MAX_RESULT_BYTES)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1024:
        raise ValueError(f"mcpServers[{name!r}]: max_result_bytes must be an integer of at least 1024, or null for "
                         f"no limit; got {value!r}")
    return value


def parse_mcp_servers(config: Mapping[str, Any] | str | Path) -> list[MCPServerConfig]:
    """Read an ``{"mcpServers": {...}}`` mapping, or a JSON/YAML file holding one.

    Raises:
        ValueError: The file or mapping has no ``mcpServers`` or an entry is invalid.
    """
    source = "MCP config"
    if isinstance(config, (str, Path)):
        source = str(config)
        text = Path(config).read_text(encoding="utf-8")
        import yaml  # JSON is YAML, so one parser reads both

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{source}: not valid JSON/YAML: {exc}") from exc
    if not isinstance(config, Mapping) or not isinstance(config.get("mcpServers"), Mapping):
        raise ValueError(f"{source}: expected a mapping with an 'mcpServers' mapping of server name -> settings")
    if not config["mcpServers"]:
        raise ValueError(f"{source}: 'mcpServers' is empty")
    return [MCPServerConfig.from_dict(str(n), raw) for n, raw in config["mcpServers"].items()]
