"""A tiny randomly initialised Qwen2-VL model (vision tower included) with a processor assembled
here, for tests and demos of the vision path; Qwen2.5-VL, Qwen3-VL and Idefics3 (SmolVLM) on
request (``family=``).

The folder is an ordinary Hugging Face checkpoint of model type ``qwen2_vl``: the tiny
tokenizer plus Qwen2-VL's vision special tokens (``<|vision_start|>``, ``<|image_pad|>``,
``<|vision_end|>``, ``<|video_pad|>``), a chat template that renders image parts and tools
(:file:`agentloop_core/testing/chat_template_vision.jinja`), ``preprocessor_config.json`` for
Qwen2-VL's image processor (its PIL backend: torchvision is never needed), and the model's
weights. ``load_vision_processor(folder, tokenizer)`` and :func:`load_vision_model` load it as
they load any real Qwen-VL folder. Built on this machine (nothing is downloaded) in seconds and
cached under ``agentloop_core.cache.cache_dir()``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from agentloop_core.cache import build_once, cache_dir
from agentloop_core.testing.tiny_tokenizer import tiny_tokenizer_path
from agentloop_core.testing.tiny_vision import (
    MAX_PIXELS,
    MIN_PIXELS,
    VISION_TOKENS,
    add_vision_tokens,
    tiny_image_processor,
)
from agentloop_engines.testing.tiny_model import save_seeded_model

TINY_VLM_VERSION = "v1"

_DEFAULTS: dict[str, Any] = {
    "family": "qwen2_vl",
    "seed": 0,
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "vision_depth": 2,
    "vision_embed_dim": 64,
    "vision_heads": 4,
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
}


def _vision_config(spec: dict[str, Any]) -> tuple[str, str, dict[str, Any], int]:
    """``(config class, model class, vision_config, patch size)`` of the family's tiny shape:
    each family names its vision tower's widths its own way."""
    family, width, heads, depth = spec["family"], spec["vision_embed_dim"], spec["vision_heads"], spec["vision_depth"]
    common = {"depth": depth, "num_heads": heads, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "initializer_range": spec["initializer_range"]}
    if family == "qwen2_vl":
        return "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {
            **common, "embed_dim": width, "hidden_size": spec["hidden_size"], "mlp_ratio": 2, "patch_size": 14}, 14
    if family == "qwen2_5_vl":
        return "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {
            **common, "hidden_size": width, "intermediate_size": 2 * width, "out_hidden_size": spec["hidden_size"],
            "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [depth - 1]}, 14
    if family == "qwen3_vl":
        return "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", {
            **common, "hidden_size": width, "intermediate_size": 2 * width, "out_hidden_size": spec["hidden_size"],
            "patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, 16
    raise ValueError(f"unknown tiny VLM family {family!r}; use one of {', '.join(FAMILIES)}")


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3")
"""The families :func:`build_tiny_vlm` builds: the Qwen-VL generations and Idefics3 (SmolVLM)."""

IDEFICS3_TILE = 64
"""The tiny Idefics3's tile side in pixels (images are resized to at most 2 x 2 tiles)."""
IDEFICS3_PATCH = 16
"""Its vision patch side: 4 x 4 patches a tile, 2 x 2 shuffled: 4 image tokens a tile."""


def _text_config(spec: dict[str, Any], vocab_size: int, eos_id: int, pad_id: int, **extra: Any) -> dict[str, Any]:
    """The language model's config of a tiny VLM (both families): the spec's sizes, the
    tokenizer's ids, no BOS; ``extra`` adds the family's own keys."""
    return {"vocab_size": vocab_size, "hidden_size": spec["hidden_size"], "intermediate_size": spec["intermediate_size"],
            "num_hidden_layers": spec["num_layers"], "num_attention_heads": spec["num_heads"],
            "num_key_value_heads": spec["num_kv_heads"], "max_position_embeddings": spec["max_position_embeddings"],
            "initializer_range": spec["initializer_range"], **extra,
            "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id}


def _build(out_dir: Path, spec: dict[str, Any]) -> None:
    if spec["family"] == "idefics3":
        _build_idefics3(out_dir, spec)
        return
    import transformers

    tokenizer = add_vision_tokens(transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer_path())))
    tokenizer.save_pretrained(str(out_dir))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    head_dim = spec["hidden_size"] // spec["num_heads"]
    # M-RoPE splits each head's rotary half into temporal/height/width sections.
    half = head_dim // 2
    sections = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    config_class, model_class, vision_config, patch = _vision_config(spec)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
    if spec["family"] == "qwen3_vl":
        rope["mrope_interleaved"] = True
    config = getattr(transformers, config_class)(
        text_config=_text_config(spec, len(tokenizer), eos_id, pad_id, rope_parameters=rope, head_dim=head_dim),
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    save_seeded_model(getattr(transformers, model_class), config, seed=spec["seed"], eos_id=eos_id, pad_id=pad_id,
                      out_dir=out_dir)
    image_processor = tiny_image_processor(spec["min_pixels"], spec["max_pixels"], patch_size=patch)
    settings = image_processor.to_dict()
    settings["min_pixels"], settings["max_pixels"] = spec["min_pixels"], spec["max_pixels"]
    (out_dir / "preprocessor_config.json").write_text(json.dumps(settings, indent=2, default=int))
    (out_dir / "agentloop_tiny_vlm.json").write_text(json.dumps({"version": TINY_VLM_VERSION, **spec}))


def _build_idefics3(out_dir: Path, spec: dict[str, Any]) -> None:
    """A tiny Idefics3: a Llama text model, a SigLIP-style vision tower over 64 px tiles, the
    tokenizer with Idefics3's special tokens and the vision template rendering ``<image>``."""
    import transformers
    from transformers import AddedToken

    from agentloop_core.testing.tiny_vision import vision_chat_template
    from agentloop_core.vision.idefics3 import IMAGE_TOKEN, idefics3_special_tokens

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                       for t in idefics3_special_tokens()]},
        replace_extra_special_tokens=False)
    tokenizer.chat_template = vision_chat_template().replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                             IMAGE_TOKEN)
    tokenizer.save_pretrained(str(out_dir))
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    config = transformers.Idefics3Config(
        text_config={"model_type": "llama", **_text_config(spec, len(tokenizer), eos_id, pad_id)},
        vision_config={"hidden_size": spec["vision_embed_dim"], "intermediate_size": 2 * spec["vision_embed_dim"],
                       "num_hidden_layers": spec["vision_depth"], "num_attention_heads": spec["vision_heads"],
                       "image_size": IDEFICS3_TILE, "patch_size": IDEFICS3_PATCH,
                       "initializer_range": spec["initializer_range"]},
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        # Taken by Idefics3Config.__post_init__ (not in its signature); its default, 128002, is
        # past the tiny vocabulary.
        pad_token_id=pad_id,  # pyright: ignore[reportCallIssue]
        tie_word_embeddings=True,
    )
    save_seeded_model(transformers.Idefics3ForConditionalGeneration, config, seed=spec["seed"], eos_id=eos_id,
                      pad_id=pad_id, out_dir=out_dir)
    settings = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IDEFICS3_TILE}, max_image_size={"longest_edge": IDEFICS3_TILE}).to_dict()
    (out_dir / "preprocessor_config.json").write_text(json.dumps(settings, indent=2, default=int))
    (out_dir / "agentloop_tiny_vlm.json").write_text(json.dumps({"version": TINY_VLM_VERSION, **spec}))


def build_tiny_vlm(path: Path | str | None = None, **overrides: Any) -> Path:
    """Build (once) a tiny random Qwen-VL checkpoint with its processor and return its folder.

    Args:
        path: Where to build it. None: ``cache_dir()/tiny-qwen2-vl-<version>`` for the default
            shape, with a short hash of the overrides appended for any other.
        **overrides: ``family`` (one of :data:`FAMILIES`: ``qwen2_vl``, the default;
            ``qwen2_5_vl``; ``qwen3_vl``, whose patches are 16 px; ``idefics3``, SmolVLM's
            architecture, 64 px tiles, ``min_pixels``/``max_pixels`` unused), and any of ``seed``, ``hidden_size``, ``num_layers``, ``num_heads``,
            ``num_kv_heads``, ``intermediate_size``, ``max_position_embeddings``,
            ``initializer_range``, ``vision_depth``, ``vision_embed_dim``, ``vision_heads``,
            ``min_pixels``, ``max_pixels`` (the image processor's resize bounds).

    Raises:
        ValueError: an unknown override, or head counts that do not divide.
        ImportError: without torch/transformers (``pip install "agentloop-engines[hf]"``).
    """
    unknown = set(overrides) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny VLM setting(s) {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
    spec = {**_DEFAULTS, **overrides}
    if spec["hidden_size"] % spec["num_heads"] or spec["num_heads"] % spec["num_kv_heads"]:
        raise ValueError("num_heads must divide hidden_size and num_kv_heads must divide num_heads")
    if spec["vision_embed_dim"] % spec["vision_heads"]:
        raise ValueError("vision_heads must divide vision_embed_dim")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('the tiny VLM needs torch and transformers: pip install "agentloop-engines[hf]"') from exc
    if path is None:
        name = f"tiny-qwen2-vl-{TINY_VLM_VERSION}"
        if spec != _DEFAULTS:
            name += "-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
        path = cache_dir() / name
    return build_once(Path(path), lambda out: _build(out, spec))
