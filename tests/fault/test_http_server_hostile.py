"""The engine server and the OpenAI gateway under hostile or careless clients, round two:
template text from the client, renders that hog the event loop, unauthenticated bodies,
stalled or trickled bodies (slowloris), and floods of concurrent requests.

Every server is real uvicorn on 127.0.0.1 in a thread; clients are httpx or raw sockets.
Slow renders and held generations are gated by events, never by sleeps, so a test waits for
a state, not for a time; the timeouts below only keep a broken server from hanging the suite.
To debug a failure, run one test with ``-s --log-cli-level=DEBUG`` and read uvicorn's log.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
from fault_helpers import read_response

httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.protocol import SamplingParams, TokenOutput  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread, session_base_path  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402

KEY = "sk-hostile-7a1c9e"
AUTH = {"Authorization": f"Bearer {KEY}"}
HANG_S = 20.0
"""How long a client waits before calling the server stuck (a safety net, not a measurement)."""
HI = [{"role": "user", "content": "hi"}]
PWNED = "{% for m in messages %}PWNED {{ m.content }}{% endfor %}"


class SlowTokenizer:
    """The real tiny tokenizer, except that rendering a message whose content is ``"SLOW"``
    blocks until :attr:`release` is set (a big render, made deterministic)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.started = threading.Event()
        self.release = threading.Event()

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        if any(m.get("content") == "SLOW" for m in messages):
            self.started.set()
            self.release.wait(HANG_S * 2)
        return self._inner.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


class HeldEngine(AsyncServerBase):
    """Generates four tokens; a request id starting with ``hold`` waits for :attr:`release`,
    and :attr:`held` counts the ones waiting; :attr:`generated` counts every call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 4096
        self.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.release = threading.Event()
        self.held = 0
        self.generated = 0
        self.gateway: Gateway | None = None
        """The gateway over this engine in :func:`both_servers` (to open sessions in)."""

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        self.generated += 1
        if request_id.startswith("hold"):
            self.held += 1
            try:
                await asyncio.to_thread(self.release.wait, HANG_S * 2)
            finally:
                self.held -= 1
        ids = [(prompt_ids[-1] + i) % 200 + 1 for i in range(1, min(sp.max_tokens, 4) + 1)]
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="length")


@contextmanager
def both_servers(tokenizer: Any, **kw: Any) -> Iterator[tuple[HeldEngine, dict[str, str]]]:
    """The engine server (its own session-less gateway) and a gateway over one engine:
    ``(engine, {"engine": url, "gateway": url})``. ``kw`` goes to both server threads."""
    engine = HeldEngine(tokenizer)
    gateway = engine.gateway = Gateway(engine, tokenizer, model_name="tiny")
    with ServerThread(engine, api_key=KEY, **kw) as srv, GatewayThread(gateway, api_key=KEY, **kw) as gw:
        yield engine, {"engine": srv.url, "gateway": gw.url}


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw_request(url: str, head: bytes, body: bytes = b"") -> socket.socket:
    """Open a socket to ``url``'s server and send ``head`` (request line and headers, without
    the blank line) and the start of a body; the caller decides what else to send."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=HANG_S)
    sock.sendall(head + b"\r\nHost: test\r\n\r\n" + body)
    return sock


# ---- 1. no client-supplied template text -------------------------------------------------------


def test_clients_cannot_choose_the_template_or_its_variables(tokenizer):
    """A request cannot make the server render template text of its choosing, nor set template
    variables outside the operator's allow-list, nor pass non-scalar or oversized values.
    Debug: the 400 message must name the field and say to configure the template on the server."""
    hostile = [
        ("chat_template", {"chat_template": PWNED}),
        ("chat_template", {"chat_template_kwargs": {"chat_template": PWNED}}),
        ("allow", {"chat_template_kwargs": {"bos_token": "PWNED"}}),
        ("allow", {"chat_template_kwargs": {"documents": [{"text": "x" * 1000}]}}),
        ("enable_thinking", {"chat_template_kwargs": {"enable_thinking": {"nested": [1, 2, 3]}}}),
        ("reasoning_effort", {"chat_template_kwargs": {"reasoning_effort": "x" * 100_000}}),
    ]
    with both_servers(tokenizer) as (_, urls), httpx.Client(timeout=HANG_S, headers=AUTH) as http:
        for name, url in urls.items():
            for needle, extra in hostile:
                r = http.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **extra})
                assert r.status_code == 400, (name, extra, r.status_code, r.text[:300])
                message = r.json()["error"]["message"]
                assert needle in message, (name, message)
                assert "PWNED" not in message, (name, message)
            # The allow-listed variable with a plain value still works.
            r = http.post(f"{url}/v1/chat/completions",
                          json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status_code == 200, (name, r.text[:300])
            assert "PWNED" not in tokenizer.decode(r.json()["prompt_token_ids"])


def test_operator_can_widen_the_template_variable_allow_list(tokenizer):
    """The allow-list is the operator's: ``PromptLimits(template_variables=...)``."""
    from agentloop_engines.serving.gateway import PromptLimits

    engine = HeldEngine(tokenizer)
    gateway = Gateway(engine, tokenizer, prompt_limits=PromptLimits(template_variables=("custom_flag",)))
    with GatewayThread(gateway) as gw:
        ok = httpx.post(f"{gw.url}/v1/chat/completions", timeout=HANG_S,
                        json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"custom_flag": True}})
        refused = httpx.post(f"{gw.url}/v1/chat/completions", timeout=HANG_S,
                             json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": True}})
    assert ok.status_code == 200, ok.text
    assert refused.status_code == 400
    assert "custom_flag" in refused.json()["error"]["message"]


# ---- 2. rendering off the event loop, with size limits -------------------------------------------


@pytest.mark.parametrize("which", ["engine", "gateway"])
def test_health_answers_while_a_slow_render_runs(tokenizer, which):
    """Rendering and tokenizing run off the event loop: while one request's render is stuck,
    ``/health`` and other requests are still answered. Debug: a ReadTimeout on /health means
    the render ran on uvicorn's loop (look for a synchronous apply_chat_template in an async def)."""
    slow = SlowTokenizer(tokenizer)
    with both_servers(slow) as (_, urls), httpx.Client(timeout=HANG_S, headers=AUTH) as http:
        url = urls[which]
        result: dict[str, Any] = {}

        def big_render() -> None:
            result["r"] = http.post(f"{url}/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "SLOW"}], "max_tokens": 2})

        worker = threading.Thread(target=big_render)
        worker.start()
        try:
            assert slow.started.wait(HANG_S), "the slow render never started"
            health = httpx.get(f"{url}/health", timeout=HANG_S / 4)
            assert health.status_code == 200
            assert not slow.release.is_set(), "the render finished before /health was asked"
        finally:
            slow.release.set()
            worker.join(HANG_S)
        assert result["r"].status_code == 200, result["r"].text[:300]


def test_prompt_size_limits_are_refused_naming_the_limit(tokenizer):
    """Over ``max_messages``, ``max_prompt_chars`` or ``max_prompt_tokens`` a request is refused
    with 413 and a message naming the limit and how to raise it, before the engine sees it."""
    from agentloop_engines.serving.gateway import PromptLimits

    limits = PromptLimits(max_messages=8, max_prompt_chars=2000, max_prompt_tokens=200)
    engine = HeldEngine(tokenizer)
    gateway = Gateway(engine, tokenizer, prompt_limits=limits)
    cases = [
        ("max_messages", "/v1/chat/completions", {"messages": HI * 9}),
        ("max_prompt_chars", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 1500}]}),
        ("max_prompt_chars", "/v1/chat/completions",
         {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "description": "d" * 3000}}]}),
        ("max_prompt_tokens", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 400}]}),
        ("max_prompt_chars", "/v1/completions", {"prompt": "a " * 1500}),
        ("max_prompt_tokens", "/v1/completions", {"prompt": "a " * 400}),
        ("max_prompt_tokens", "/v1/completions", {"prompt": [5] * 201}),
    ]
    with (ServerThread(engine, prompt_limits=limits) as srv, GatewayThread(gateway) as gw,
          httpx.Client(timeout=HANG_S) as http):
        for base in (gw.url, srv.url):
            generated = engine.generated
            for limit, path, body in cases:
                r = http.post(base + path, json={**body, "max_tokens": 2})
                assert r.status_code == 413, (base, limit, r.status_code, r.text[:300])
                message = r.json()["error"]["message"]
                assert limit in message, (base, limit, message)
                assert "raise" in message, (base, limit, message)
            assert engine.generated == generated, "a refused prompt reached the engine"
            assert http.post(base + "/v1/chat/completions", json={"messages": HI * 8, "max_tokens": 2}).status_code == 200


# ---- 3. authenticate before reading the body ------------------------------------------------------


@pytest.mark.parametrize("which", ["engine", "gateway"])
@pytest.mark.parametrize("framing", ["content-length", "huge-content-length", "chunked"])
def test_unauthenticated_requests_are_401_before_the_body_is_read(tokenizer, which, framing):
    """Without a valid bearer token the server answers 401 at once, without waiting for a body
    that never finishes. Debug: a socket timeout here means the body was read before the auth
    check (the auth check must run in the ASGI middleware, before any receive())."""
    head = {"content-length": b"Content-Length: 60000",
            "huge-content-length": b"Content-Length: 100000000000",
            "chunked": b"Transfer-Encoding: chunked"}[framing]
    body = b"1000\r\n" + b"x" * 100 if framing == "chunked" else b'{"messages": ['
    with both_servers(tokenizer, max_request_bytes=64 * 1024) as (_, urls):
        for auth in (b"", b"\r\nAuthorization: Bearer wrong", b"\r\nAuthorization: " + KEY.encode()):
            sock = raw_request(urls[which], b"POST /v1/chat/completions HTTP/1.1\r\n"
                               b"Content-Type: application/json\r\n" + head + auth, body)
            with sock:
                response = read_response(sock)
            assert response.startswith(b"HTTP/1.1 401"), response[:300]
            assert b"Bearer" in response
            assert KEY.encode() not in response


# ---- 4. read timeouts (slowloris) -------------------------------------------------------------------


@pytest.mark.parametrize("which", ["engine", "gateway"])
def test_stalled_and_trickled_bodies_are_cut_off(tokenizer, which):
    """A client that sends headers and then stalls, or trickles the body a byte at a time, is
    answered 408 and disconnected after ``body_timeout_s``, while other clients are served."""
    from agentloop_engines.serving.common import ServerLimits

    limits = ServerLimits(body_timeout_s=1.0)
    with both_servers(tokenizer, limits=limits) as (_, urls):
        url = urls[which]
        head = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 5000" + (
            b"\r\nAuthorization: Bearer " + KEY.encode())
        stalled = raw_request(url, head, b'{"messages": [')
        trickled = raw_request(url, head, b"")
        sent = 0
        stop = threading.Event()

        def trickle() -> None:
            nonlocal sent
            try:
                while not stop.is_set() and sent < 4999:
                    trickled.sendall(b" ")
                    sent += 1
                    time.sleep(0.05)
            except OSError:
                pass  # the server hung up: what we want

        worker = threading.Thread(target=trickle)
        worker.start()
        try:
            # Other clients are served while both are stuck.
            r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=HANG_S,
                           json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 200, r.text[:300]
            for sock in (stalled, trickled):
                with sock:
                    response = read_response(sock)
                assert response.startswith(b"HTTP/1.1 408"), response[:300]
                assert b"body_timeout_s" in response
        finally:
            stop.set()
            worker.join(HANG_S)
        assert sent < 4999, "the trickled body was read to the end"


def test_silent_and_slow_request_heads_are_disconnected(tokenizer):
    """A connection that sends nothing is closed ``first_byte_timeout_s`` after it connected, and
    one that sends its request head a line at a time ``header_timeout_s`` after its first byte
    (uvicorn's keep-alive timer stops at the first byte, so without these both would be held
    forever). Debug: check ``uvicorn_config`` passes the header-deadline protocol class as ``http=``."""
    from agentloop_engines.serving.common import ServerLimits

    with both_servers(tokenizer, limits=ServerLimits(header_timeout_s=1.0, first_byte_timeout_s=1.0)) as (_, urls):
        for url in urls.values():
            host, port = url.removeprefix("http://").split(":")
            silent = socket.create_connection((host, int(port)), timeout=HANG_S)
            slow = socket.create_connection((host, int(port)), timeout=HANG_S)
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n")
            lines = 0
            try:
                while lines < 400:  # 20 s of headers at most
                    slow.sendall(b"X-Slow: %d\r\n" % lines)
                    lines += 1
                    time.sleep(0.05)
            except OSError:
                pass  # the server hung up
            assert lines < 400, "the server kept reading a request head for 20 s"
            for sock in (silent, slow):
                # A reset (closed with our unread headers) is also a hang-up.
                with sock, suppress(ConnectionResetError):
                    assert read_response(sock) == b""
            assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200


def test_a_client_slow_to_start_its_request_is_still_answered(tokenizer):
    """The head's clock starts at its first byte: a client that connects, or finishes a request,
    and only writes its next request after longer than ``header_timeout_s`` (a process starved
    of CPU with hundreds of requests to send) is answered, not reset under a request already on
    its way. A head that then trickles is still cut ``header_timeout_s`` after its first byte.
    Debug: ``HeaderDeadlineProtocol`` must arm ``header_timeout_s`` in ``data_received``, not
    in ``connection_made`` or ``on_response_complete``."""
    from agentloop_engines.serving.common import ServerLimits

    limits = ServerLimits(header_timeout_s=0.5, first_byte_timeout_s=HANG_S, keep_alive_timeout_s=int(HANG_S))
    body = b'{"request_id": "late", "prompt_ids": [1, 2], "sampling_params": {"max_tokens": 2}}'
    request = (b"POST /generate HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + KEY.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    with both_servers(tokenizer, limits=limits) as (_, urls):
        host, port = urls["engine"].removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
            for _ in range(2):  # on a fresh connection, then on the same kept-alive one
                time.sleep(1.5)  # three header deadlines of silence
                sock.sendall(request)
                response = read_response(sock)
                assert response.startswith(b"HTTP/1.1 200"), response[:300]
                assert b'"token_ids"' in response, response[:300]
            time.sleep(1.5)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\n")
            started = time.monotonic()
            with suppress(ConnectionResetError):
                assert read_response(sock) == b"", "a head left incomplete was answered"
            assert time.monotonic() - started < HANG_S / 2, "the incomplete head was held past header_timeout_s"


def test_a_request_already_sent_is_not_closed_by_the_keep_alive_timer():
    """The keep-alive timer firing while the next request already waits in the kernel (written
    as the timer fired, not yet read by a busy event loop) leaves the connection open and the
    request is answered; uvicorn's own handler closes it under the request, which the client
    sees as a reset. Debug: ``HeaderDeadlineProtocol.timeout_keep_alive_handler`` must ask
    ``_bytes_waiting`` (FIONREAD) before closing."""
    from uvicorn.server import ServerState

    from agentloop_engines.serving.common import ServerLimits, uvicorn_config

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    request = b"GET /x HTTP/1.1\r\nHost: test\r\n\r\n"

    async def read_one(sock: socket.socket) -> bytes:
        data = b""
        while not data.endswith(b"ok"):
            chunk = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65536), HANG_S)
            if not chunk:
                return data
            data += chunk
        return data

    async def main() -> None:
        loop = asyncio.get_running_loop()
        config = uvicorn_config(app, "127.0.0.1", 0, ServerLimits(), log_level="warning")
        config.load()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            client = socket.create_connection(listener.getsockname())
            accepted, _ = listener.accept()
        protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, accepted)
        client.setblocking(False)
        try:
            await loop.sock_sendall(client, request)
            assert (await read_one(client)).startswith(b"HTTP/1.1 200")
            transport.pause_reading()  # the event loop is busy elsewhere
            await loop.sock_sendall(client, request)
            await asyncio.sleep(0.1)
            protocol.timeout_keep_alive_handler()  # ... when the keep-alive timer fires
            assert not transport.is_closing(), "the connection was closed under a request already sent"
            transport.resume_reading()
            assert (await read_one(client)).startswith(b"HTTP/1.1 200")
            protocol.timeout_keep_alive_handler()  # nothing waiting now: an idle connection is closed
            assert transport.is_closing()
        finally:
            client.close()
            transport.close()

    asyncio.run(main())


# ---- 5. a concurrency limit --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["engine", "gateway"])
def test_requests_over_the_in_flight_limit_get_503_at_once(tokenizer, which):
    """At most ``max_in_flight`` requests are served at once; the next one gets 503 with
    Retry-After immediately (not queued), and ``/health`` is exempt."""
    from agentloop_engines.serving.common import ServerLimits

    with both_servers(tokenizer, limits=ServerLimits(max_in_flight=2)) as (engine, urls):
        url = urls[which]
        path, body = (("/generate", {"request_id": "hold-{}", "prompt_ids": [1, 2], "sampling_params": {}})
                      if which == "engine" else
                      ("{}/chat/completions", {"messages": HI, "max_tokens": 2}))
        results: list[Any] = []

        def at(i: int) -> str:  # a gateway session's URL carries its session key
            if which == "engine":
                return url + path.format(i)
            assert engine.gateway is not None
            return url + path.format(session_base_path(f"hold-{i}", engine.gateway.open_session(f"hold-{i}")))

        def held(i: int) -> None:
            data = {**body, "request_id": f"hold-{i}"} if which == "engine" else body
            results.append(httpx.post(at(i), headers=AUTH, json=data, timeout=HANG_S * 2))

        workers = [threading.Thread(target=held, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        try:
            wait_until(lambda: engine.held == 2, "two held generations")
            over = httpx.post(at(9), headers=AUTH, timeout=HANG_S / 4,
                              json={**body, "request_id": "hold-9"} if which == "engine" else body)
            assert over.status_code == 503, over.text[:300]
            assert over.headers.get("retry-after")
            assert "max_in_flight" in over.json()["error"]["message"]
            assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200
        finally:
            engine.release.set()
            for w in workers:
                w.join(HANG_S * 2)
        assert [r.status_code for r in results] == [200, 200], [r.text[:200] for r in results]
