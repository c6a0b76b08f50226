"""A CPU stand-in for ``sglang.Engine``, faithful to the parts of SGLang that ``SGLangServer`` calls.

SGLang needs a GPU, so the adapter (and anything built on it, such as ``agentloop train
actor_rollout_ref.rollout.name=sglang``) is tested against this class. It enforces what the real
engine enforces and misbehaves the way SGLang does (each point checked on a real SGLang build; see
:class:`StandInSGLangEngine`), so a test over it fails on an adapter that trusts SGLang where it
should not. It records what it was asked to do (``events``, ``weight_updates``, ``calls``) so a
test can check, for example, that each weight update arrived while the scheduler was idle.

To put it behind ``SGLangServer(model_path=...)`` (which builds ``sglang.Engine`` itself)::

    monkeypatch.setattr("agentloop_engines.adapters.sglang.server._require_sglang",
                        lambda: SimpleNamespace(Engine=StandInSGLangEngine))

Imports nothing beyond the standard library.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import tempfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["DEFAULT_EOS_TOKEN_ID", "DEFAULT_VOCAB_SIZE", "StandInSGLangEngine", "WeightUpdate", "write_checkpoint"]

DEFAULT_EOS_TOKEN_ID = 2
"""EOS of the checkpoint :func:`write_checkpoint` writes (and of a stand-in built without a model_path)."""
DEFAULT_VOCAB_SIZE = 300
"""Vocabulary size of that checkpoint."""
DEFAULT_WEIGHT_NAMES = ("step", "model.embed_tokens.weight")
"""Tensors of that checkpoint: ``step`` is the stand-in's one real weight (see the class docstring)."""

# SGLang builds SamplingParams(**sampling_params), so any other key is a TypeError there.
_SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
                            "sampling_seed", "logit_bias"})


def write_checkpoint(folder: Path, names: Iterable[str] = DEFAULT_WEIGHT_NAMES, tied: bool = True,
                     index: bool = False, vocab_size: int = DEFAULT_VOCAB_SIZE,
                     eos_token_id: int = DEFAULT_EOS_TOKEN_ID, max_position_embeddings: int = 64,
                     dtype: str | None = "float32") -> Path:
    """Write a safetensors checkpoint holding one int64 scalar per name (the header is all that
    SGLang's name check and the stand-in read) and its ``config.json``.

    Args:
        folder: Where to write (created if missing).
        names: Tensor names.
        tied: ``tie_word_embeddings`` (then ``lm_head.weight`` is not in the checkpoint).
        index: Also write ``model.safetensors.index.json``, as sharded checkpoints have.
        vocab_size: ``config.json``'s ``vocab_size``.
        eos_token_id: ``config.json``'s ``eos_token_id``.
        max_position_embeddings: The context length the stand-in uses without ``context_length``.
        dtype: ``config.json``'s ``dtype`` (what ``dtype="auto"`` resolves from); None: not written.

    Returns:
        ``folder``.
    """
    names = list(names)
    folder.mkdir(parents=True, exist_ok=True)
    header = {n: {"dtype": "I64", "shape": [], "data_offsets": [8 * i, 8 * i + 8]} for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8 * len(names)))
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    config = {"tie_word_embeddings": tied, "vocab_size": vocab_size, "eos_token_id": eos_token_id,
              "max_position_embeddings": max_position_embeddings}
    if dtype is not None:
        config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config))
    return folder


SGLANG_QWEN_FACTOR, SGLANG_QWEN_MIN_PIXELS, SGLANG_QWEN_MAX_PIXELS = 28, 4 * 28 * 28, 16384 * 28 * 28
"""How SGLang's Qwen-VL multimodal processor resizes a decoded image before the checkpoint's own
image processor sees it (``qwen_vl.py``: ``resize_image`` with ``IMAGE_FACTOR``, ``MIN_PIXELS`` and
``SGLANG_IMAGE_MAX_PIXELS``), whatever the checkpoint's ``preprocessor_config.json`` says."""


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's resize rule: both sides multiples of ``factor``, the area within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _image_settings(folder: Path) -> dict[str, int]:
    """The checkpoint's image processor settings that decide a Qwen-VL image's token count."""
    file = folder / "preprocessor_config.json"
    settings = json.loads(file.read_text()) if file.is_file() else {}
    size = settings.get("size") or {}
    return {"patch": int(settings.get("patch_size", 14)), "merge": int(settings.get("merge_size", 2)),
            "min_pixels": int(settings.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            "max_pixels": int(settings.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)}


def _tensor_names(folder: Path) -> frozenset[str]:
    # SGLang's loader walks the checkpoint's tensors the same way. Deliberately not the adapter's
    # _checkpoint_weight_names: the stand-in plays SGLang, so a bug in the adapter's reader must
    # show up as a mismatch, not be shared.
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return frozenset(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            names.update(k for k in json.loads(fh.read(size)) if k != "__metadata__")
    if not names:
        raise FileNotFoundError(f"no safetensors tensors in {folder} (the stand-in loads safetensors only)")
    return frozenset(names)


@dataclass(frozen=True)
class WeightUpdate:
    """One ``update_weights_from_tensor`` call, as the stand-in received it."""

    names: tuple[str, ...]
    """Tensor names, in the order sent."""
    skipped: tuple[str, ...]
    """Names the model has no parameter for, skipped silently as SGLang does (a tied
    ``lm_head.weight`` is one of them, on purpose)."""
    running: int
    """Requests the scheduler counted as running when the update was applied (0: idle)."""
    flush_cache: bool
    """The ``flush_cache`` argument."""


class StandInSGLangEngine:
    """Next token = (last + step) % vocab_size, ``step`` being the checkpoint's ``step`` weight
    (1 until an update sends one; a real checkpoint has none, so it stays 1), plus a coin flip
    when temperature > 0; logprob -0.01 * (token % 7).

    Like SGLang (measured outside the project):
    (a) ``ignore_eos=True`` disables ``stop_token_ids`` too, not only EOS;
    (b) a finished request still counts as running until a later loop pass (``finish_lag_s``);
        ``flush_cache`` returns False while anything runs; ``update_weights_from_tensor`` (with
        its default ``flush_cache=True``) and ``release_memory_occupation`` assert the scheduler
        is idle, and a failed assertion kills the engine: every later call fails. Writing weights
        while the memory is released kills it too;
    (c) ``sampling_seed`` is ignored unless ``enable_deterministic_inference``;
    (d) the tokenizer manager rejects prompt + max_new_tokens >= context_len; the scheduler
        refuses a prompt of ``max_req_input_len`` tokens or more (``>=``, SGLang's
        ``validate_input_length``) with its ValueError "Input length (N tokens) exceeds the maximum
        allowed length (M tokens)...", and cuts new tokens to max_req_len - prompt - 1, where
        max_req_len = min(context_len, max_total_tokens) - 1 and max_req_input_len = max_req_len - 5
        (so context_len - 6 and context_len - prompt - 2 with a large enough KV pool);
    (e) ``server_args`` tell whether the memory saver is on; without it release frees nothing;
    (f) unknown weight names are skipped silently; the model's parameters are the tensors of the
        checkpoint in ``server_args.model_path``;
    (g) ``dtype="auto"`` (the default) runs a float32 checkpoint in float16 and keeps a 16-bit
        checkpoint's dtype (``model_dtype``); the stand-in's arithmetic does not depend on it;
    (h) a vision-language checkpoint (``config.json`` with a ``vision_config``, e.g. the tiny
        Qwen2-VL) takes ``image_data``: a list (anything else is SGLang's TypeError), one image per
        run of image tokens in ``input_ids`` (the prompt's expanded ``<|image_pad|>`` blocks), each
        run as long as SGLang's processor makes that image: its Qwen-VL processor first resizes
        the image itself (multiples of 28 within its own pixel bounds,
        :data:`SGLANG_QWEN_MIN_PIXELS`/:data:`SGLANG_QWEN_MAX_PIXELS`), then the checkpoint's
        processor resizes that again within ``preprocessor_config.json``'s bounds; for an image
        larger than the checkpoint's ``max_pixels`` the two resizes can end on another grid than
        one resize of the original. A text-only checkpoint refuses ``image_data``. Outputs
        depend on the images' pixels (each step adds ``crc32(pixels) % 97`` summed over images).
        Unlike (a)-(g), (h) is read from SGLang's source (``multimodal/processors/qwen_vl.py``,
        ``base_processor.py``), not yet measured on a GPU: ``test_real_sglang_serves_images``
        (gpu-marked, ``tests/test_sglang_vision.py``) checks it there.

    Args:
        model_path: A local checkpoint folder (safetensors and ``config.json``): weight names,
            ``vocab_size``, ``eos_token_id`` and the default context length come from it. None:
            a temporary :func:`write_checkpoint` checkpoint (``step`` and a tied
            ``model.embed_tokens.weight``), removed by :meth:`shutdown`.
        context_length: SGLang's ``context_length``; None: the checkpoint's
            ``max_position_embeddings``.
        enable_memory_saver: Whether ``release_memory_occupation`` frees memory (e).
        enable_deterministic_inference: Whether ``sampling_seed`` is honoured (c).
        random_seed: Seeds the sampling coin flips.
        tp_size: Recorded in ``server_args``; no effect (one process, no GPU).
        mem_fraction_static: Recorded in ``server_args``; no effect (there is no KV pool to size).
        max_total_tokens: SGLang's KV pool size in tokens; None: larger than the context. Lowers
            ``max_req_input_len`` and the new-token budget when smaller than the context (d).
        dtype: ``server_args.dtype``; resolved into ``model_dtype`` as SGLang does (g). No effect
            on outputs (the stand-in computes no activations).
        step_delay_s: Stand-in only: sleep per decoded token, to keep requests in flight.
        finish_lag_s: Stand-in only: how long a returned request still counts as running (b).
        **server_args: Other ``sglang.ServerArgs`` fields (e.g. ``disable_cuda_graph``): recorded
            in ``server_args``, no effect. Real SGLang rejects names it lacks; the stand-in does
            not know SGLang's full list, so it cannot.

    Raises:
        FileNotFoundError: when ``model_path`` is not a local checkpoint folder (no hub download).

    Attributes:
        events: Control calls in order (``flush_cache``, ``update_weights_from_tensor``,
            ``release_memory_occupation``, ``resume_memory_occupation``, ``shutdown``).
        weight_updates: One :class:`WeightUpdate` per accepted ``update_weights_from_tensor``.
        calls: One dict per ``async_generate`` (rid, input_ids, the sampling params and, with
            images, ``image_sizes``).
        dead: Why the engine died (a failed SGLang assertion), or None.
        model_dtype: The dtype SGLang would run the weights in (g).
        image_token_id: The image placeholder's id of a vision-language checkpoint, else None (h).
    """

    def __init__(self, model_path: str | None = None, *, context_length: int | None = None,
                 enable_memory_saver: bool = False, enable_deterministic_inference: bool = False,
                 random_seed: int | None = None, tp_size: int = 1, mem_fraction_static: float | None = None,
                 max_total_tokens: int | None = None, dtype: str = "auto", step_delay_s: float = 0.0,
                 finish_lag_s: float = 0.01, **server_args: Any) -> None:
        self._checkpoint: tempfile.TemporaryDirectory[str] | None = None
        if model_path is None:
            self._checkpoint = tempfile.TemporaryDirectory(prefix="standin-sglang-")
            folder = write_checkpoint(Path(self._checkpoint.name))
        else:
            folder = Path(model_path)
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"model_path {model_path!r} is not a local checkpoint folder with a "
                                        "config.json (the SGLang stand-in downloads nothing)")
        config = json.loads((folder / "config.json").read_text())
        self.parameter_names = _tensor_names(folder)
        # A vision-language config keeps the language model's sizes in text_config.
        text = {**config.get("text_config", {}), **config}
        eos = text.get("eos_token_id")
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        context_len = int(context_length or text["max_position_embeddings"])
        multimodal = "vision_config" in config
        self.image_token_id: int | None = int(config["image_token_id"]) if multimodal else None
        self._image_settings = _image_settings(folder) if multimodal else {}
        # Like sglang.Engine: the loop running at construction, else a new one (never started here).
        try:
            self.loop = asyncio.get_running_loop()
            self._owns_loop = False
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
            self._owns_loop = True
        self.server_args = SimpleNamespace(
            model_path=str(folder), context_length=context_length,
            enable_memory_saver=enable_memory_saver, enable_deterministic_inference=enable_deterministic_inference,
            random_seed=random_seed, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
            max_total_tokens=max_total_tokens, dtype=dtype, **server_args)
        declared = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        self.model_dtype = dtype if dtype != "auto" else ("float16" if declared == "float32" else declared)
        self.step = 1
        self.step_delay_s = step_delay_s
        self.finish_lag_s = finish_lag_s
        self.running = 0
        self.released = False
        self.memory_freed = False
        self.dead: str | None = None
        self.flushes = 0
        self.calls: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.weight_updates: list[WeightUpdate] = []
        self.live: dict[str, bool] = {}
        self.shut_down = False
        self._rng = random.Random(random_seed)
        # Like SGLang's scheduler: one request fits in the context and in the KV pool.
        self.max_req_len = min(context_len, max_total_tokens or context_len) - 1
        self.tokenizer_manager = SimpleNamespace(
            context_len=context_len, max_req_input_len=self.max_req_len - 5,
            model_config=SimpleNamespace(
                vocab_size=int(text["vocab_size"]), is_multimodal=multimodal,
                hf_config=SimpleNamespace(image_token_id=self.image_token_id,
                                          vision_config=SimpleNamespace(**config["vision_config"]) if multimodal else None)),
            abort_request=self._abort_request)

    def _check_alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"the SGLang scheduler process died earlier: {self.dead}")

    def _die(self, why: str, exc_type: type[Exception] = AssertionError) -> None:
        self.dead = why
        raise exc_type(why)

    def _assert_idle(self, what: str) -> None:
        if self.running:
            self._die(f"{what}: AssertionError: the scheduler is not idle ({self.running} running)")

    def _abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        assert asyncio.get_running_loop() is self.loop, "abort_request called off the engine loop"
        if rid in self.live:
            self.live[rid] = True

    def _finished(self) -> None:
        self.running -= 1

    def _image_tokens(self, size: tuple[int, int]) -> int:
        """How many image tokens SGLang's Qwen-VL processing makes of an image of ``size`` (h)."""
        width, height = size
        h, w = _smart_resize(height, width, SGLANG_QWEN_FACTOR, SGLANG_QWEN_MIN_PIXELS, SGLANG_QWEN_MAX_PIXELS)
        s = self._image_settings
        h, w = _smart_resize(h, w, s["patch"] * s["merge"], s["min_pixels"], s["max_pixels"])
        return (h // s["patch"]) * (w // s["patch"]) // s["merge"] ** 2

    def _check_images(self, input_ids: list[int], image_data: Any) -> int:
        """Refuse ``image_data`` as SGLang would (h); return the images' effect on the outputs."""
        if self.image_token_id is None:
            raise ValueError("image_data was sent to a text-only model: SGLang serves images only with a multimodal "
                             "checkpoint (config.json with a vision_config)")
        if not isinstance(image_data, list):
            raise TypeError(f"IMAGE must be a list or None, got {type(image_data)}")
        for i, image in enumerate(image_data):
            if not (hasattr(image, "size") and hasattr(image, "tobytes")):
                # SGLang also loads paths, URLs, base64 and processor outputs; SGLangServer sends none.
                raise TypeError(f"image_data[{i}] is a {type(image).__name__}; the SGLang stand-in takes PIL images")
        runs, start = [], None
        for i, tok in enumerate([*input_ids, None]):
            if tok == self.image_token_id and start is None:
                start = i
            elif tok != self.image_token_id and start is not None:
                runs.append(i - start)
                start = None
        expected = [self._image_tokens(image.size) for image in image_data]
        if runs != expected:
            # SGLang does not refuse this: it falls back to re-tokenizing the decoded prompt with its
            # own counts, a prompt of another length than the trainer's. The stand-in refuses, so a
            # test sees it.
            raise ValueError(f"input_ids hold image token runs of {runs} but SGLang's processor makes {expected} of the "
                             f"{len(image_data)} image(s) (sizes {[image.size for image in image_data]})")
        return sum(zlib.crc32(image.tobytes()) % 97 for image in image_data)

    async def async_generate(self, input_ids: list[int] | None = None, sampling_params: dict[str, Any] | None = None,
                             return_logprob: bool = False, rid: str | None = None,
                             image_data: Any = None) -> dict[str, Any]:
        if input_ids is None or sampling_params is None or rid is None:
            # SGLang also takes text prompts and makes up rids; SGLangServer never relies on either.
            raise TypeError("the SGLang stand-in serves token prompts only: pass input_ids, sampling_params and rid")
        self._check_alive()
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("async_generate awaited off engine.loop (the real engine hangs here)")
        if self.released:
            raise RuntimeError("memory released; resume_memory_occupation first")
        assert set(sampling_params) <= _SAMPLING_KEYS, sampling_params
        assert rid not in self.live, f"duplicate live rid {rid}"
        tm, n, max_new = self.tokenizer_manager, len(input_ids), sampling_params["max_new_tokens"]
        if n + max_new >= tm.context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{tm.context_len} tokens ({n} input + {max_new} new)")
        shift = 0 if image_data is None else self._check_images(input_ids, image_data)
        call = {"rid": rid, "input_ids": list(input_ids), **sampling_params}
        if image_data is not None:
            call["image_sizes"] = [image.size for image in image_data]
        self.calls.append(call)
        if n >= tm.max_req_input_len:
            # The scheduler aborts it with status 400, which the tokenizer manager raises as this.
            raise ValueError(f"Input length ({n} tokens) exceeds the maximum allowed length "
                             f"({tm.max_req_input_len} tokens). Use a shorter input or enable "
                             "--allow-auto-truncate.")
        meta: dict[str, Any] = {"id": rid}
        max_new = min(max_new, self.max_req_len - n - 1)
        stops = set() if sampling_params["ignore_eos"] else {*self.eos_token_ids, *sampling_params["stop_token_ids"]}
        rng = self._rng
        if self.server_args.enable_deterministic_inference and "sampling_seed" in sampling_params:
            rng = random.Random(sampling_params["sampling_seed"])
        vocab, bias = tm.model_config.vocab_size, sampling_params.get("logit_bias") or {}
        self.live[rid] = False
        self.running += 1
        ids, last, reason = [], input_ids[-1], {"type": "length", "length": max_new}
        try:
            while len(ids) < max_new:
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if self.live[rid]:
                    reason = {"type": "abort", "message": "aborted"}
                    break
                noise = rng.randint(0, 1) if sampling_params["temperature"] > 0 else 0
                last = (last + self.step + noise + shift) % vocab
                while bias.get(str(last), 0.0) <= -1e4:  # like SGLang's logit_bias: a banned id is never drawn
                    last = (last + 1) % vocab
                ids.append(last)
                if last in stops:
                    reason = {"type": "stop", "matched": last}
                    break
        finally:
            del self.live[rid]
            self.loop.call_later(self.finish_lag_s, self._finished)
        meta["finish_reason"] = reason
        if return_logprob:
            meta["output_token_logprobs"] = [(-0.01 * (t % 7), t, None) for t in ids]
        return {"text": "", "output_ids": ids, "meta_info": meta}

    async def _bump(self, **changes):
        await asyncio.sleep(0)
        for k, v in changes.items():
            setattr(self, k, v)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._check_alive()
        self.events.append("update_weights_from_tensor")
        if flush_cache:
            self._assert_idle("update_weights_from_tensor")
        if self.released:
            self._die("update_weights_from_tensor: the weights' memory is released (illegal memory access)",
                      RuntimeError)
        weights = dict(named_tensors)
        step = int(weights.get("step", self.step))
        if step <= 0:
            return False, "step must be positive"
        self.weight_updates.append(WeightUpdate(
            names=tuple(weights), skipped=tuple(n for n in weights if n not in self.parameter_names),
            running=self.running, flush_cache=bool(flush_cache)))
        self.loop.run_until_complete(self._bump(step=step, flushes=self.flushes + flush_cache))
        return True, "Success"

    def flush_cache(self):
        self._check_alive()
        self.events.append("flush_cache")
        return self.loop.run_until_complete(self._flush())

    async def _flush(self) -> bool:
        await asyncio.sleep(0)
        if self.running:
            return False
        self.flushes += 1
        return True

    def release_memory_occupation(self, tags=None):
        self._check_alive()
        self.events.append("release_memory_occupation")
        self._assert_idle("release_memory_occupation")
        self.loop.run_until_complete(self._bump(released=True,
                                                memory_freed=self.server_args.enable_memory_saver))

    def resume_memory_occupation(self, tags=None):
        self._check_alive()
        self.events.append("resume_memory_occupation")
        self.loop.run_until_complete(self._bump(released=False, memory_freed=False))

    def shutdown(self):
        """Stop the engine; the stand-in also removes its temporary checkpoint and closes the loop
        it created (once nothing runs it any more)."""
        self.events.append("shutdown")
        self.shut_down = True
        if self._checkpoint is not None:
            self._checkpoint.cleanup()
        if self._owns_loop and not self.loop.is_running():
            self.loop.close()
