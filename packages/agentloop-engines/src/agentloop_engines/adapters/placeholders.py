"""Image and video placeholder tokens: a vision-language model reads them, it never writes them.

A prompt expands each image to a run of placeholder tokens (``config.image_token_id``; videos
``config.video_token_id``) whose embeddings the vision tower fills in. A policy that *generates*
one breaks its trajectory: the next turn's prompt holds more placeholders than images, every
engine refuses it (:func:`agentloop_core.vision.processor.image_token_runs`) and the sample
fails. So every engine bans these ids from sampling, greedy included:

* HFServer masks them in :func:`agentloop_engines.adapters.hf.sampling.sample_rows`;
* VLLMServer passes them as ``bad_words`` (their single-token strings: vLLM sets each to -inf
  before greedy and random sampling), or as ``logit_bias`` -100 (vLLM's largest) for an id whose
  string does not tokenize back to it;
* SGLangServer passes ``logit_bias`` -1e9 for each (SGLang adds it to the logits before greedy
  and random sampling; ``exp`` of it is exactly 0 in float32, and unlike ``-inf`` it survives
  SGLang's JSON routes).

Log-probs: one convention everywhere. An engine returns the sampled token's log-prob under the
banned distribution, ``log_softmax`` of ``logits / T`` with the placeholder columns at ``-inf``
(renormalised over the other tokens): HFServer computes it after its ban
(:mod:`agentloop_engines.adapters.hf.sampling`), vLLM (``processed_logprobs``) and SGLang after their
logit processors, and the trainer recomputes it with the same columns removed
(``agentloop_trainer.update.placeholder_mask``). It exceeds the full-vocabulary log-prob by
``-log(1 - P_T(placeholders))``, 0 to float precision unless the policy puts real mass on
placeholders (up to 4e-2 on the random tiny Qwen2-VL). Text-only models ban nothing.

Tiled images: vLLM and SGLang take a token prompt with one placeholder (vLLM) or one run
(SGLang) per image and expand or fill it by their own processor. An Idefics3/SmolVLM image fills
several runs of image tokens with the tiles' text between them
(:class:`~agentloop_core.vision.TiledImageItem`), which neither adapter can hand over exactly, so
both refuse it (:func:`refuse_tiled_images`) before the engine sees it; HFServer serves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.protocol import CapabilityNotSupportedError

__all__ = ["PLACEHOLDER_KEYS", "SGLANG_BAN", "placeholder_token_ids", "refuse_tiled_images", "sglang_logit_bias",
           "vllm_ban"]

PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
"""The config fields that name a vision-language model's placeholder ids (``*_index``: the
older Llava-style spelling)."""

SGLANG_BAN = -1e9
"""The logit bias that bans a token in SGLang: its probability underflows to exactly 0."""


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def placeholder_token_ids(config: Any, vocab_size: int | None = None) -> tuple[int, ...]:
    """The image and video placeholder ids a vision-language model's config names, sorted;
    ``()`` for a text-only model (a config without ``vision_config``).

    Args:
        config: A Hugging Face config (object) or a ``config.json`` mapping.
        vocab_size: When given, ids outside ``[0, vocab_size)`` are left out (nothing can sample
            them).
    """
    if config is None or _field(config, "vision_config") is None:
        return ()
    ids = set()
    for name in PLACEHOLDER_KEYS:
        value = _field(config, name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            ids.add(int(value))
    return tuple(sorted(t for t in ids if vocab_size is None or t < vocab_size))


def vllm_ban(token_ids: tuple[int, ...], tokenizer: Any) -> dict[str, Any]:
    """``vllm.SamplingParams`` keywords that ban ``token_ids``: ``bad_words`` with each id's
    token string where the tokenizer turns that string back into exactly that id (vLLM tokenizes
    ``bad_words`` itself, and a one-token bad word is set to -inf at every step), else
    ``logit_bias`` -100, the most vLLM allows (it clamps biases to [-100, 100]).

    Args:
        token_ids: The ids to ban (:func:`placeholder_token_ids`); empty gives ``{}``.
        tokenizer: The served model's Hugging Face tokenizer (vLLM loads the same one).
    """
    words: list[str] = []
    bias: dict[int, float] = {}
    for token_id in token_ids:
        text = None if tokenizer is None else tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(text, str) and text and tokenizer.encode(text, add_special_tokens=False) == [token_id]:  # pyright: ignore[reportOptionalMemberAccess] - text is None without a tokenizer
            words.append(text)
        else:
            bias[token_id] = -100.0
    return {**({"bad_words": words} if words else {}), **({"logit_bias": bias} if bias else {})}


def sglang_logit_bias(token_ids: tuple[int, ...]) -> dict[str, float]:
    """SGLang's ``logit_bias`` (string ids) that bans ``token_ids``: :data:`SGLANG_BAN` each,
    added to the logits before greedy and random sampling."""
    return {str(t): SGLANG_BAN for t in token_ids}


def refuse_tiled_images(images: Sequence[Any], engine: str) -> None:
    """Refuse images that fill several runs of image tokens (tiled: Idefics3/SmolVLM).

    Args:
        images: The request's :class:`~agentloop_core.vision.ImageItem` list, in order.
        engine: The adapter's name, for the message.

    Raises:
        CapabilityNotSupportedError: for the first tiled image, naming what is supported where.
    """
    for k, item in enumerate(images):
        runs = len(item.run_lengths)
        if runs > 1:
            tiles = f"{item.rows} x {item.cols} tiles and a global view" if hasattr(item, "rows") else "tiles"
            raise CapabilityNotSupportedError(
                f"{engine} cannot take image {k} ({str(item.digest)[:19]}): it fills {runs} runs of image tokens "
                f"({tiles}, the Idefics3/SmolVLM family), and {engine}'s token prompt carries one run per image, "
                f"so the model would not read the prompt the trainer scores. {engine} serves images of the Qwen-VL "
                "family (qwen2_vl, qwen2_5_vl, qwen3_vl); serve an Idefics3/SmolVLM checkpoint with HFServer "
                "(agentloop_engines.adapters.hf.server.HFServer)")
