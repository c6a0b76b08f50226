"""The engine suite against EngineHTTPClient: HFServer on the tiny Qwen2 model, served by uvicorn on
127.0.0.1 in a thread and reached over HTTP. The HTTP hop must change nothing the suite checks;
the capabilities come from the server's /health, so the same checks apply as in-process."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
for _module in ("httpx", "fastapi", "uvicorn"):
    pytest.importorskip(_module, reason='EngineHTTPClient needs pip install "agentloop-engines[server]"')
pytest_asyncio = pytest.importorskip("pytest_asyncio", reason="needs pytest-asyncio")

from agentloop_conformance import EngineConformanceTests, hf_named_weights, hf_reference_log_probs  # noqa: E402


@pytest.fixture(scope="class")
def served_hf():
    """HFServer behind a uvicorn thread; yields (engine, server thread)."""
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.server import ServerThread
    from agentloop_engines.testing.tiny_model import build_tiny_model

    # A larger init than the default makes greedy outputs depend on the prompt.
    engine = HFServer(build_tiny_model(initializer_range=0.3), max_model_len=1024)
    with ServerThread(engine, api_key="conformance-key") as thread:
        yield engine, thread


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def http_engine(served_hf):
    from agentloop_engines.fleet.http_client import EngineHTTPClient

    server = EngineHTTPClient(served_hf[1].url, api_key="conformance-key", control_key=served_hf[1].control_key)
    await server.connect()
    yield server
    await server.close()


class TestRemoteServerConformance(EngineConformanceTests):
    @pytest.fixture
    def engine(self, http_engine):
        return http_engine

    # The hooks read the model inside the served engine: the one the HTTP requests reach.
    @pytest.fixture
    def reference_log_probs(self, served_hf):
        return hf_reference_log_probs(served_hf[0].model)

    @pytest.fixture
    def named_weights(self, served_hf):
        return hf_named_weights(served_hf[0].model)
