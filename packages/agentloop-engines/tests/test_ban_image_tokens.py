"""A vision-language model's image and video placeholder ids are never sampled, by any engine
(:mod:`agentloop_engines.adapters.placeholders`): HFServer's sampler (greedy, sampled, top-k, batched
with text rows), HFServer on a tiny Qwen2-VL whose lm_head prefers the placeholders, and the
sampling parameters VLLMServer and SGLangServer send (SGLang's against its stand-in; vLLM's
real engine in test_ban_image_tokens_vllm.py, ``nox -s vllm``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentloop_engines.adapters.hf.sampling import RowSampling, _ban_, sample_rows  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.adapters.placeholders import SGLANG_BAN, placeholder_token_ids, vllm_ban  # noqa: E402
from agentloop_engines.adapters.sglang.server import SGLangServer  # noqa: E402
from agentloop_engines.adapters.vllm.server import VLLMServer  # noqa: E402
from agentloop_engines.testing import StandInSGLangEngine  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

BANNED = (7, 8)


def _row(temperature: float, seed: int = 0, top_k: int = 0, banned: tuple[int, ...] = BANNED) -> RowSampling:
    generator = None
    if temperature > 0:
        generator = torch.Generator().manual_seed(seed)
    return RowSampling(temperature, top_k, 1.0, generator, banned)


def _logits(rows: int, vocab: int = 50, seed: int = 0):
    """Logits where the banned ids hold nearly all the mass (as a policy that wants them)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    logits[:, 7] += 20.0
    logits[:, 8] += 15.0
    return logits


def _allowed(logits):
    """``logits`` with the banned columns at -inf: the distribution every engine reports."""
    allowed = logits.clone()
    allowed[:, list(BANNED)] = float("-inf")
    return allowed


def test_greedy_takes_the_best_allowed_token_with_its_log_prob_over_the_allowed_tokens():
    logits = _logits(4)
    tokens, lps = sample_rows(logits, [_row(0.0) for _ in range(4)])
    allowed = _allowed(logits)
    assert tokens.tolist() == allowed.argmax(-1).tolist()
    # The log-prob is over the allowed tokens (as vLLM, SGLang and the trainer take it): the best
    # of them is near 0 here, where the full vocabulary's would be about -15.
    expected = torch.log_softmax(allowed, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps, expected)
    full = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert (lps - full).min() > 5


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_sampled_rows_never_draw_a_banned_token(temperature):
    logits = _logits(64, seed=1)
    tokens, lps = sample_rows(logits, [_row(temperature, seed=i) for i in range(64)])
    assert not set(tokens.tolist()) & set(BANNED)
    assert len(set(tokens.tolist())) > 5  # a draw, not a fixed fallback
    expected = torch.log_softmax(_allowed(logits) / temperature, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps, expected)


def test_top_k_keeps_the_best_allowed_tokens():
    logits = _logits(32, seed=2)
    tokens, _ = sample_rows(logits, [_row(1.0, seed=i, top_k=2) for i in range(32)])
    allowed = logits.clone()
    allowed[:, list(BANNED)] = float("-inf")
    best_two = allowed.topk(2, -1).indices
    assert all(t in best_two[i].tolist() for i, t in enumerate(tokens.tolist()))


def test_a_ban_changes_nothing_for_rows_without_it_nor_for_draws_it_does_not_hit():
    """A text row batched with banned rows draws what it draws alone, with the same log-prob; a
    seeded banned row whose draw was no banned id draws the same token as without the ban (the
    same noise), its log-prob over the allowed tokens."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    rows = [_row(1.0, seed=i, banned=BANNED if i % 2 else ()) for i in range(6)]
    tokens, lps = sample_rows(logits, rows)
    free, free_lps = sample_rows(logits, [_row(1.0, seed=i, banned=()) for i in range(6)])
    allowed = torch.log_softmax(_allowed(logits), -1)
    for i in range(6):
        if i % 2 == 0:
            assert tokens[i] == free[i], i
            assert lps[i] == free_lps[i], i
        elif free[i].item() not in BANNED:
            assert tokens[i] == free[i], i
            torch.testing.assert_close(lps[i], allowed[i, tokens[i]])


def test_nothing_banned_touches_nothing():
    """The text-only path keeps its speed: without bans the logits are not written to."""
    scaled = torch.randn(3, 20)
    before = scaled.clone()
    assert not _ban_(scaled, [_row(1.0, banned=()) for _ in range(3)])
    assert torch.equal(scaled, before)
    assert _ban_(scaled, [_row(1.0), _row(1.0, banned=()), _row(0.0)])
    assert scaled[[0, 2]][:, list(BANNED)].isneginf().all()
    assert torch.equal(scaled[1], before[1])


def test_placeholder_token_ids_from_configs():
    vlm = transformers.AutoConfig.from_pretrained(str(build_tiny_vlm()))
    assert placeholder_token_ids(vlm) == (vlm.image_token_id, vlm.video_token_id)
    assert placeholder_token_ids(vlm.to_dict()) == (vlm.image_token_id, vlm.video_token_id)
    assert placeholder_token_ids(vlm, vocab_size=vlm.video_token_id) == (vlm.image_token_id,)
    assert placeholder_token_ids(transformers.AutoConfig.from_pretrained(str(build_tiny_model()))) == ()
    assert placeholder_token_ids({"image_token_id": 5}) == ()  # no vision_config: not a vision model


@pytest.fixture(scope="module")
def vlm_path():
    return str(build_tiny_vlm(initializer_range=0.3))


@pytest.fixture(scope="module")
def vlm_config(vlm_path):
    return json.loads((Path(vlm_path) / "config.json").read_text())


def _placeholder_loving_model(path: str):
    """The tiny Qwen2-VL with an lm_head bias that puts the image placeholder ~30 nats above
    every ordinary token and the video placeholder ~15 above them."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    head = model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    bias[model.config.image_token_id] = 30.0
    bias[model.config.video_token_id] = 15.0
    head.bias = torch.nn.Parameter(bias)
    return model.eval()


async def test_hfserver_bans_only_a_vision_models_placeholders(vlm_path, vlm_config):
    vlm = HFServer(vlm_path)
    assert vlm.banned_token_ids == (vlm_config["image_token_id"], vlm_config["video_token_id"])
    text = HFServer(str(build_tiny_model()))
    assert text.banned_token_ids == ()
    await asyncio.gather(vlm.close(), text.close())


async def test_hfserver_never_generates_a_placeholder_the_model_wants(vlm_path, vlm_config):
    """Greedy and sampled, batched, the model's favourite ids never come out, and each log-prob is
    ``log_softmax(logits / T)`` of a plain forward pass with the placeholder columns removed (the
    trainer's number; the full vocabulary's would be about -15 to -30 here, as the placeholders
    hold the mass)."""
    model = _placeholder_loving_model(vlm_path)
    banned = {vlm_config["image_token_id"], vlm_config["video_token_id"]}
    prompt = [11, 12, 13, 14, 15]
    with torch.no_grad():
        first = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert first.argmax().item() == vlm_config["image_token_id"]  # what an unbanned greedy step takes
    server = HFServer(model, tokenizer=vlm_path)
    params = [{"max_tokens": 8, "temperature": t, "seed": i, "ignore_eos": True, "logprobs": True}
              for i, t in enumerate([0.0, 0.0, 0.7, 1.0, 1.0])]
    outs = await asyncio.gather(*(server.generate(f"r{i}", prompt, p) for i, p in enumerate(params)))
    for p, out in zip(params, outs, strict=True):
        assert not banned & set(out.token_ids), (p, out.token_ids)
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        scale = p["temperature"] or 1.0
        logits[:, sorted(banned)] = float("-inf")
        ref = torch.log_softmax(logits / scale, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(out.log_probs or [], ref.tolist(), strict=True)) < 2e-3
    await server.close()


def test_vllm_params_ban_the_placeholders_as_bad_words(vlm_path, vlm_config):
    """The ``SamplingParams`` VLLMServer builds (vLLM's class stood in by a recorder: vLLM is not
    installed here): ``bad_words`` with the placeholders' strings, which the tokenizer turns
    back into exactly those ids (vLLM tokenizes them itself)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_path)
    ids = (vlm_config["image_token_id"], vlm_config["video_token_id"])
    ban = vllm_ban(ids, tokenizer)
    assert ban == {"bad_words": ["<|image_pad|>", "<|video_pad|>"]}
    assert [tokenizer.encode(w, add_special_tokens=False) for w in ban["bad_words"]] == [[i] for i in ids]
    assert vllm_ban(ids, None) == {"logit_bias": {ids[0]: -100.0, ids[1]: -100.0}}  # no tokenizer: vLLM's strongest bias
    assert vllm_ban((), tokenizer) == {}

    server = VLLMServer.__new__(VLLMServer)
    server._vllm = SimpleNamespace(SamplingParams=lambda **kwargs: kwargs)
    server._ban = ban
    from agentloop_core.protocol import SamplingParams

    params = server._vllm_params(SamplingParams(max_tokens=4, temperature=0.0))
    assert params["bad_words"] == ["<|image_pad|>", "<|video_pad|>"]
    assert params["temperature"] == 0.0


@pytest.fixture
def sglang_vlm(vlm_path):
    engine = StandInSGLangEngine(vlm_path)
    yield engine
    engine.loop.close()


@pytest.fixture
def sglang_text():
    engine = StandInSGLangEngine(str(build_tiny_model()))
    yield engine
    engine.loop.close()


async def test_sglang_params_ban_the_placeholders_and_the_stand_in_skips_them(sglang_vlm, vlm_path, vlm_config):
    """SGLangServer sends ``logit_bias`` -1e9 for both placeholders. The stand-in (next token =
    previous + 1) walks through the vocabulary as SGLang samples with that bias: past them.
    Without the bias it steps onto both."""
    image, video = vlm_config["image_token_id"], vlm_config["video_token_id"]
    server = SGLangServer(sglang_vlm, tokenizer=transformers.AutoTokenizer.from_pretrained(vlm_path))
    assert server.banned_token_ids == (image, video)
    out = await server.generate("walk", [image - 3], {"max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert sglang_vlm.calls[-1]["logit_bias"] == {str(image): SGLANG_BAN, str(video): SGLANG_BAN}
    vocab = server.vocab_size  # the placeholders are the tiny VLM's last ids: the walk wraps to 0
    assert out.token_ids == [image - 2, image - 1, *((video + k) % vocab for k in (1, 2, 3))]
    await server.close()


async def test_sglang_sends_no_bias_for_a_text_model(sglang_text):
    server = SGLangServer(sglang_text)
    assert server.banned_token_ids == ()
    await server.generate("t", [5], {"max_tokens": 2, "temperature": 0})
    assert "logit_bias" not in sglang_text.calls[-1]
    await server.close()
