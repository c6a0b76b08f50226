"""A server command started as a subprocess on a free loopback port, waited on until it answers
``/health``: how the serving tests run ``agentloop-serve`` and ``agentloop serve`` for real."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Mapping, Sequence

import httpx


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: Sequence[str], env: Mapping[str, str], what: str,
                 timeout_s: float = 120.0) -> tuple[subprocess.Popen[str], str]:
    """Run ``argv`` plus ``--port <free port>`` and return the process and its base URL once
    ``/health`` answers 200.

    Raises:
        AssertionError: the process exited first (with its output) or did not answer within
            ``timeout_s`` (it is killed); ``what`` names the command in the message.
    """
    port = free_port()
    proc = subprocess.Popen([*argv, "--port", str(port)], env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited:\n{proc.communicate()[0]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not start")
        time.sleep(0.5)
