"""One bad row must not sink its batch (issue 18): when HFServer's per-row sampling raises for
one request, only that request fails and the others sharing its forward passes complete. If
this fails, look at ``DecodeBatch._sample`` in agentloop_engines/adapters/hf/batch.py: an exception
from ``sample_rows`` must be narrowed to the rows that raise, not delivered to every row."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.adapters.hf import batch as hf_batch  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402

POISON_T = 0.375
"""The temperature that marks the request whose sampling blows up."""


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.mark.parametrize("fail_at_token", [0, 3], ids=["prefill", "decode"])
async def test_a_row_that_raises_fails_alone(model_path, monkeypatch, fail_at_token):
    """Two concurrent requests share a batch; sampling raises for one of them (at its first
    token, or mid-decode). That one gets the error; the other returns all its tokens."""
    real = hf_batch.sample_rows
    seen = {"poison_calls": 0}

    def flaky(logits, rows):
        if any(r.temperature == POISON_T for r in rows):
            seen["poison_calls"] += 1
            if seen["poison_calls"] > fail_at_token:
                raise RuntimeError("boom in per-row sampling")
        return real(logits, rows)

    monkeypatch.setattr(hf_batch, "sample_rows", flaky)
    server = HFServer(model_path, max_batch_size=8, batch_wait_s=0.05)
    try:
        good, bad = await asyncio.gather(
            server.generate("good", [10, 20, 30], {"max_tokens": 8, "temperature": 0, "ignore_eos": True}),
            server.generate("bad", [11, 21, 31], {"max_tokens": 8, "temperature": POISON_T, "ignore_eos": True}),
            return_exceptions=True,
        )
        assert list(server.batch_sizes) == [2], "both requests must share one batch for this test"
        assert isinstance(bad, RuntimeError)
        assert "boom" in str(bad)
        assert not isinstance(good, BaseException), f"the healthy request failed too: {good!r}"
        assert len(good.token_ids) == 8
        assert good.stop_reason == "length"
        # The engine keeps serving afterwards.
        again = await server.generate("after", [1, 2, 3], {"max_tokens": 2, "temperature": 0})
        assert len(again.token_ids) >= 1
    finally:
        await server.close()
