"""HFServer's log-probs under the placeholder ban follow the one convention every engine and the
trainer share (:mod:`agentloop_engines.adapters.placeholders`): ``log_softmax(logits / T)`` with the
image/video placeholder logits at -inf. Checked on the tiny Qwen2-VL edited so the image
placeholder leads every ordinary token by ~30 nats (the full-vocabulary log-probs are then
about -29), against the conformance suite's reference hook (which removes the same ids for a
vision model); a text model's log-probs stay the full vocabulary's."""

from __future__ import annotations

import asyncio
import math

import pytest

torch = pytest.importorskip("torch")
placeholder_model = pytest.importorskip("agentloop_conformance.placeholder_model",
                                        reason="needs the conformance package (pip install -e conformance)")

from agentloop_conformance import hf_reference_log_probs  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

PROMPT = [11, 12, 13, 14, 15]
RUNS = [(0.0, None), (0.7, 1), (1.0, 2), (1.0, 3)]


@pytest.fixture(scope="module")
def preferring(tmp_path_factory):
    folder = placeholder_model.placeholder_preferring_checkpoint(build_tiny_vlm(initializer_range=0.3),
                                                                 tmp_path_factory.mktemp("placeholder-vlm"))
    return str(folder)


def _full_vocabulary(model, generated: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + generated])).logits[0, len(PROMPT) - 1 : -1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return lp.gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()


async def _generate(server: HFServer) -> list:
    params = [{"max_tokens": 6, "temperature": t, "seed": s, "ignore_eos": True, "logprobs": True} for t, s in RUNS]
    return await asyncio.gather(*(server.generate(f"p{i}", PROMPT, p) for i, p in enumerate(params)))


async def test_hfserver_log_probs_are_the_banned_distributions(preferring):
    """Greedy and sampled: each log-prob equals the reference hook's (the placeholder columns
    removed) within 1e-4, and lies nats above the full vocabulary's; the greedy ones are at least
    ``-log(vocab_size)`` (the best allowed token), as the conformance check demands."""
    server = HFServer(preferring)
    reference = hf_reference_log_probs(server.model)
    outs = await _generate(server)
    for (temperature, _), out in zip(RUNS, outs, strict=True):
        ref = reference(PROMPT, out.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(out.log_probs, ref, strict=True)) < 1e-4, temperature
        full = _full_vocabulary(server.model, out.token_ids, temperature)
        assert min(a - b for a, b in zip(out.log_probs, full, strict=True)) > 1.0, temperature
        if temperature == 0:
            assert min(out.log_probs) >= -math.log(server.vocab_size)
    await server.close()


async def test_a_text_models_log_probs_stay_the_full_vocabularys():
    server = HFServer(str(build_tiny_model(initializer_range=0.3)))
    assert server.banned_token_ids == ()
    reference = hf_reference_log_probs(server.model)
    outs = await _generate(server)
    for (temperature, _), out in zip(RUNS, outs, strict=True):
        full = _full_vocabulary(server.model, out.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(out.log_probs, full, strict=True)) < 1e-4
        assert reference(PROMPT, out.token_ids, temperature) == pytest.approx(full, abs=1e-6)
    await server.close()
