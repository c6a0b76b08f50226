"""``serve_until_gone``: a request whose client goes away before its answer is cancelled; one
whose answer was complete is left to finish."""

from __future__ import annotations

import asyncio

import pytest

from agentloop_engines.serving.watch import serve_until_gone


class Client:
    """The server side of one connection: ``receive`` answers ``http.disconnect`` once ``leave``
    is called (or the answer is complete), ``send`` records what the app sent."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.gone.set()  # as uvicorn: receive returns disconnect once the answer is complete


async def test_a_client_that_leaves_mid_request_cancels_it():
    client = Client()
    events: list[str] = []

    async def app(scope, receive, send):
        events.append((await receive())["body"].decode())
        try:
            await asyncio.sleep(30)  # a generation
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    serving = asyncio.create_task(serve_until_gone(app, {"path": "/generate"}, b"the body", client.receive,
                                                   client.send))
    await asyncio.sleep(0.05)
    client.gone.set()
    await asyncio.wait_for(serving, 5)
    assert events == ["the body", "cancelled"]


async def test_work_after_a_complete_answer_is_not_cancelled():
    client = Client()
    finished = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        assert (await receive())["type"] == "http.disconnect"
        await asyncio.sleep(0.1)  # background work after the answer
        finished.set()

    await asyncio.wait_for(serve_until_gone(app, {}, b"", client.receive, client.send), 5)
    assert finished.is_set()
    assert [m["type"] for m in client.sent] == ["http.response.start", "http.response.body"]


async def test_the_apps_own_error_propagates():
    client = Client()

    async def app(scope, receive, send):
        raise RuntimeError("handler bug")

    with pytest.raises(RuntimeError, match="handler bug"):
        await serve_until_gone(app, {}, b"", client.receive, client.send)


async def test_a_stream_whose_client_leaves_is_not_left_waiting():
    client = Client()
    heard: list[str] = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"chunk", "more_body": True})
        heard.append((await receive())["type"])  # a streaming response listens for the disconnect

    serving = asyncio.create_task(serve_until_gone(app, {}, b"", client.receive, client.send))
    await asyncio.sleep(0.05)
    assert not serving.done()
    client.gone.set()
    await asyncio.wait_for(serving, 5)  # cancelled, or it heard the disconnect: never left waiting
    assert heard in ([], ["http.disconnect"])
