"""Engine checks with images (:class:`EngineVisionTests`), for engines that declare
``capabilities.vision``."""

from __future__ import annotations

import asyncio
import math
from typing import Any, ClassVar

import pytest

from agentloop_conformance.engine_fixtures import EngineFixtures, greedy
from agentloop_conformance.placeholder_model import engine_placeholder_ids
from agentloop_conformance.vision_prompts import default_vision_prompt, noise_image

__all__ = ["EngineVisionTests"]


class EngineVisionTests(EngineFixtures):
    """Images (engines that declare ``capabilities.vision``): valid output from prompts with
    images, outputs that depend on the images, and clear refusals."""

    __conformance_suite__ = True

    vision_min_logprob_gap: ClassVar[float] = 1e-4
    """When two different images give the same greedy tokens, the least their log-probs must
    differ by somewhere (an engine that ignores images gives the same to ~1e-6)."""

    def vision(self, engine: Any, vision_prompt: Any) -> Any:
        if not self.capability(engine, "vision"):
            pytest.skip("engine declares capabilities.vision=False (a text-only model, or no image support)")
        if vision_prompt is None:
            pytest.skip("no vision_prompt hook: override the `vision_prompt` fixture (images, text) -> (prompt_ids, "
                        "multi_modal_data), or expose the engine's `tokenizer` and checkpoint folder (`model_path`)")
        return vision_prompt

    @pytest.fixture
    def placeholder_engine(self, engine: Any) -> Any:
        """Optional hook: an engine like ``engine`` serving a vision-language checkpoint that always
        wants to generate an image placeholder, then a video one (write it from any Qwen-VL-style
        checkpoint with :func:`agentloop_conformance.placeholder_model.placeholder_preferring_checkpoint`);
        None skips the placeholder-ban check."""
        return None

    async def test_vision_never_generates_placeholder_tokens(self, placeholder_engine: Any) -> None:
        """No image or video placeholder id is ever generated, greedy or at temperature 1, even by
        a model whose top choices they are (``placeholder_engine``); log-probs stay finite, and
        the next turn (the prompt plus the generated ids, the same images) is served. Debug: ban
        ``config.image_token_id``/``video_token_id`` in the sampler (HFServer:
        ``RowSampling.banned``; vLLM: ``bad_words``; SGLang: ``logit_bias``). A generated
        placeholder makes the next prompt hold more image tokens than images: refused.

        Log-probs follow the one convention every engine and the trainer share: the token's
        log-prob under the banned distribution, ``log_softmax(logits / T)`` with the placeholder
        logits at ``-inf`` (renormalised over the other tokens), not under the full vocabulary.
        Checked where it is exact without a reference: a greedy token is the most likely allowed
        one, so its log-prob is at least ``-log(vocab_size)``; over the full vocabulary it would
        be about ``-image_margin`` (30 nats) here. Debug: take the log-softmax after the ban."""
        if placeholder_engine is None:
            pytest.skip("no placeholder_engine hook: override it to serve a placeholder_preferring_checkpoint(...)")
        engine = placeholder_engine
        prompt = self.vision(engine, default_vision_prompt(engine))
        banned = set(engine_placeholder_ids(engine))
        ids, data = prompt([noise_image(56, 84, 8)], "Describe the image.")
        sampled = {"max_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": True}
        runs = [greedy(self.max_tokens), *({**sampled, "seed": s} for s in range(3))]
        outs = await asyncio.gather(*(engine.generate(f"ph{i}", ids, p, multi_modal_data=data)
                                      for i, p in enumerate(runs)))
        for params, out in zip(runs, outs, strict=True):
            out = self.check_output(out, "placeholder-preferring model")
            where = f"T={params['temperature']}, seed={params.get('seed')}"
            generated = [t for t in out.token_ids if t in banned]
            assert not generated, f"{where}: generated placeholder ids {generated} (banned: {sorted(banned)})"
            assert len(out.token_ids) == self.max_tokens, f"{where}: {len(out.token_ids)} tokens"
            assert all(math.isfinite(lp) and lp <= 1e-6 for lp in out.log_probs or []), f"{where}: {out.log_probs}"
            if params["temperature"] == 0 and out.log_probs is not None:
                floor = -math.log(self.vocab_size(engine)) - 1e-3
                low = [round(lp, 3) for lp in out.log_probs if lp < floor]
                assert not low, (
                    f"{where}: greedy log-probs {low} are below -log(vocab_size) = {floor:.3f}: not the banned "
                    "distribution's (log_softmax with the placeholder logits at -inf, the convention every engine and "
                    "the trainer use) but the full vocabulary's, which counts the placeholders' mass")
        follow = self.check_output(await engine.generate("ph-next", ids + outs[0].token_ids, greedy(4),
                                                         multi_modal_data=data), "next turn")
        assert len(follow.token_ids) == 4, f"next turn: {len(follow.token_ids)} tokens, expected 4"
        assert not banned & set(follow.token_ids), f"next turn generated placeholders: {follow.token_ids}"

    async def test_vision_prompt_with_images_gives_valid_output(self, engine: Any, vision_prompt: Any) -> None:
        """A prompt with two images of different sizes returns ``max_tokens`` in-vocabulary ids
        with one finite log-prob <= 0 each, the same ids twice (greedy). Debug: the image
        tokens' embeddings must come from the vision tower (pixel values, grid sizes), with the
        model's own positions for them (M-RoPE for Qwen-VL)."""
        prompt = self.vision(engine, vision_prompt)
        v = self.vocab_size(engine)
        ids, data = prompt([noise_image(112, 84, 0), noise_image(56, 140, 1)], "Describe both images.")
        outs = [self.check_output(await engine.generate(f"vis{i}", ids, greedy(self.max_tokens), multi_modal_data=data),
                                  "prompt with images") for i in range(2)]
        out = outs[0]
        assert len(out.token_ids) == self.max_tokens, f"asked for {self.max_tokens} tokens, got {len(out.token_ids)}"
        assert out.stop_reason == "length", f"stop_reason is {out.stop_reason!r}, expected 'length'"
        assert all(isinstance(t, int) and 0 <= t < v for t in out.token_ids), f"ids outside [0, {v}): {out.token_ids}"
        if self.capability(engine, "logprobs"):
            assert out.log_probs is not None, "logprobs=True but log_probs is None"
            assert len(out.log_probs) == len(out.token_ids), "one log-prob per generated token"
            bad = [lp for lp in out.log_probs if not (isinstance(lp, float) and math.isfinite(lp) and lp <= 1e-6)]
            assert not bad, f"log-probs must be finite floats <= 0, got {bad[:5]}"
        assert outs[1].token_ids == out.token_ids, "greedy output with images differs between two identical requests"

    async def test_vision_images_change_the_output(self, engine: Any, vision_prompt: Any) -> None:
        """The same text with two different images (of one size, so the prompt ids are the same)
        gives different greedy tokens or, with the same tokens, log-probs that differ by more
        than ``vision_min_logprob_gap``. Debug: an engine that drops ``multi_modal_data`` runs the
        image tokens as text and answers every image alike."""
        prompt = self.vision(engine, vision_prompt)
        ids_a, data_a = prompt([noise_image(112, 112, 2)], "What is in the image?")
        ids_b, data_b = prompt([noise_image(112, 112, 3)], "What is in the image?")
        a = self.check_output(await engine.generate("img-a", ids_a, greedy(self.max_tokens), multi_modal_data=data_a), "a")
        b = self.check_output(await engine.generate("img-b", ids_b, greedy(self.max_tokens), multi_modal_data=data_b), "b")
        if a.token_ids != b.token_ids:
            return
        if not (a.log_probs and b.log_probs):
            pytest.fail(f"two different images gave the same greedy tokens {a.token_ids} and no log-probs to compare")
        gap = max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True))
        assert gap > self.vision_min_logprob_gap, (
            f"two different images gave the same tokens {a.token_ids} with log-probs at most {gap:.2e} apart "
            f"(<= {self.vision_min_logprob_gap}): the images do not reach the model")

    async def test_vision_images_not_matching_the_prompt_are_a_value_error(self, engine: Any, vision_prompt: Any) -> None:
        """``multi_modal_data`` whose images do not fill the prompt's image tokens (one image too
        many, or an image of another token count) raises ValueError, and the engine serves the
        matching request afterwards. Debug: count the prompt's image tokens against each image's
        (``ImageItem.num_tokens``) before running anything; an engine that expands images itself
        may otherwise run a prompt of another length than the trainer scores."""
        prompt = self.vision(engine, vision_prompt)
        ids, data = prompt([noise_image(56, 56, 4)], "What is in the image?")
        images = list(data["image"])
        with pytest.raises(ValueError, match=r"(?i)image"):
            await asyncio.wait_for(engine.generate("extra", ids, greedy(4), multi_modal_data={"image": images * 2}), 30)
        _, other = prompt([noise_image(168, 168, 5)], "What is in the image?")
        if [i.num_tokens for i in other["image"]] != [i.num_tokens for i in images]:
            with pytest.raises(ValueError, match=r"(?i)image"):
                await asyncio.wait_for(engine.generate("other", ids, greedy(4), multi_modal_data=other), 30)
        out = self.check_output(await engine.generate("matching", ids, greedy(4), multi_modal_data=data), "matching")
        assert len(out.token_ids) == 4, "the engine did not serve a matching request after refusing others"

    async def test_vision_video_is_a_value_error(self, engine: Any, vision_prompt: Any) -> None:
        """``multi_modal_data`` with a ``video`` key raises ValueError naming it (videos are not
        part of the protocol: frames go as images). Debug: validate the keys before queueing."""
        prompt = self.vision(engine, vision_prompt)
        ids, data = prompt([noise_image(56, 56, 6)], "What is in the image?")
        with pytest.raises(ValueError, match=r"(?i)video"):
            await asyncio.wait_for(engine.generate("video", ids, greedy(4), multi_modal_data={"video": data["image"]}), 30)

    async def test_vision_text_requests_unchanged_beside_image_requests(self, engine: Any, vision_prompt: Any) -> None:
        """Text requests in flight together with requests with images get the output they get
        alone. Debug: an image row's embeddings or positions leaking into the batch's other rows."""
        prompt = self.vision(engine, vision_prompt)
        texts = self.prompts(engine)[:2]
        alone = [await engine.generate(f"txt{i}", p, greedy(self.max_tokens)) for i, p in enumerate(texts)]
        ids, data = prompt([noise_image(84, 56, 7)], "What is in the image?")
        mixed = await asyncio.gather(
            *(engine.generate(f"mix-t{i}", p, greedy(self.max_tokens)) for i, p in enumerate(texts)),
            *(engine.generate(f"mix-i{i}", ids, greedy(self.max_tokens), multi_modal_data=data) for i in range(2)))
        for i, (a, b) in enumerate(zip(alone, mixed[: len(texts)], strict=True)):
            assert a.token_ids == b.token_ids, f"text prompt {i}: output changed beside requests with images"
