"""``SGLangServer``: the token-level server API over an in-process ``sglang.Engine``.

The adapter calls only this part of the engine's surface: ``async_generate(input_ids=...,
sampling_params=..., return_logprob=True, rid=...)`` (and ``image_data=[...]`` for a prompt with
images) awaited on ``engine.loop``;
``update_weights_from_tensor``, ``flush_cache``, ``release_memory_occupation`` and
``resume_memory_occupation`` (synchronous: they run ``engine.loop.run_until_complete``);
``engine.tokenizer_manager`` (``context_len``, ``max_req_input_len``, ``model_config`` with its
``vocab_size``, ``is_multimodal`` and ``hf_config``, ``abort_request``) and ``engine.server_args``.

Where SGLang departs from the agentloop contract, and what the adapter does about it:

* ``ignore_eos`` switches off *every* stop token (``Req.check_finished`` skips the whole stop
  check) and a request cannot take EOS out of SGLang's stop set. So the adapter passes
  ``ignore_eos`` and cuts the output after the first requested stop token: up to there it is
  exactly what SGLang sampled (stop checks never change sampling), at the cost of decoding on
  to ``max_tokens``.
* ``update_weights_from_tensor`` and ``release_memory_occupation`` flush the cache and assert the
  scheduler is idle, and it may count a request that just returned as running for one more
  loop pass: the assertion kills the engine. The adapter holds new requests back, waits for its
  own, retries ``flush_cache`` (it fails while the scheduler is busy), then updates with
  ``flush_cache=False`` or releases memory.
* ``sampling_seed`` is honoured only with ``enable_deterministic_inference`` (which the CPU
  attention backend rejects): ``per_request_seed`` says so. Seeded requests are still served
  (the conformance suite and ``sampling_seed`` runs send seeds), with a warning once.
* The scheduler refuses a prompt of ``max_req_input_len`` tokens *or more* (``>=``: a prompt of
  exactly that length fails too, with SGLang's "Input length (N tokens) exceeds the maximum
  allowed length (N tokens)"), and cuts new tokens to ``max_req_len - prompt - 1``, where
  ``max_req_len = min(context_len, KV pool size) - 1 = max_req_input_len + 5``: the adapter
  raises its own ValueError before sending such a prompt (``max_prompt_len =
  max_req_input_len - 1``) and clamps ``max_tokens`` itself (``max_model_len =
  min(context_len - 2, max_req_input_len + 4)``, i.e. ``context_len - 2`` unless the KV pool is
  smaller than the context).
* Sleep frees memory only with ``enable_memory_saver=True``: ``capabilities.sleep`` says so.
* The loader skips unknown weight names with a log line: ``update_weights`` checks them against
  the checkpoint's safetensors headers and raises.
* Images (a vision-language checkpoint: ``capabilities.vision``) go as ``image_data``, one per
  run of image tokens in the (expanded) ``input_ids``, in order. SGLang's Qwen-VL processor
  resizes each image twice: by its own rule (multiples of 28 within its own pixel bounds), then
  within the checkpoint's; above the checkpoint's ``max_pixels`` that can end on another grid
  than the prompt's (300 x 200 at 224 x 224 max: 12 x 20 patches, not 12 x 18). So each image
  goes at the size the rendering processor resized it to (``image_grid_thw`` x patch), where
  both resizes are the identity: the same token count and the same pixel values. A prompt whose
  image tokens are not its images', or a tiled (Idefics3) image, is refused before SGLang sees it.
* A vision model's image and video placeholder ids are never sampled (``logit_bias``; see
  :mod:`agentloop_engines.adapters.placeholders`). SGLang's log-probs come after that bias, so they are
  renormalised over the other tokens: the convention HFServer and the trainer share.

Needs the ``[sglang]`` extra and a GPU; the adapter logic is tested here against a stand-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from agentloop_core.engine_registry import EngineConfig
from agentloop_core.protocol import CapabilityNotSupportedError, SamplingParams, TokenOutput
from agentloop_core.vision.processor import ImageItem, image_token_runs
from agentloop_engines.adapters.dtypes import default_engine_dtype, local_checkpoint_folder
from agentloop_engines.adapters.placeholders import refuse_tiled_images, sglang_logit_bias
from agentloop_engines.adapters.sglang.engine_loop import EngineLoopThread
from agentloop_engines.adapters.sglang.vision import checkpoint_config, sglang_vision
from agentloop_engines.adapters.weight_check import WeightSpec, check_weight_update, checkpoint_weight_specs
from agentloop_engines.base import AsyncServerBase
from agentloop_engines.plugins import SGLANG_ENGINE

__all__ = ["SGLangServer"]

logger = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}


CONFIG_ARGUMENTS = {"seed": "random_seed", "tensor_model_parallel_size": "tp_size",
                    "gpu_memory_utilization": "mem_fraction_static", "free_cache_engine": "enable_memory_saver",
                    "dtype": "dtype", "max_model_len": "context_length"}
"""The :class:`~agentloop_core.engine_registry.EngineConfig` fields SGLang takes, by
``sglang.Engine``'s names."""


def _require_sglang() -> Any:
    try:
        import sglang  # pyright: ignore[reportMissingImports] - the [sglang] extra; not in the lint session (GBs)
    except ImportError as exc:
        raise ImportError('SGLangServer needs SGLang: pip install "agentloop-engines[sglang]"') from exc
    return sglang


def _checkpoint_weight_names(model_path: str) -> frozenset[str] | None:
    """The weight names of a safetensors checkpoint (the names SGLang's loader accepts), or None
    when the folder (or its copy in the Hugging Face cache) cannot be read."""
    specs = _checkpoint_specs(model_path)
    return None if specs is None else frozenset(specs)


def _checkpoint_specs(model_path: str) -> dict[str, WeightSpec] | None:
    folder = local_checkpoint_folder(model_path)
    return None if folder is None else checkpoint_weight_specs(folder)  # None: not cached here


class SGLangServer(AsyncServerBase):
    """Serve an SGLang engine (GPU) behind ``AsyncServerBase``.

    Args:
        engine: A started ``sglang.Engine`` (or an object with the same surface). None: one is
            built from ``model_path`` and ``engine_kwargs``.
        model_path: Model folder or hub id, used when ``engine`` is None.
        tokenizer: Hugging Face tokenizer, for EOS ids and an HTTP server's OpenAI ``/v1`` routes.
        context_len: The model's context length; from the engine's tokenizer manager if omitted.
        max_req_input_len: SGLang's ``max_req_input_len`` (it refuses prompts of this many tokens
            or more); from the tokenizer manager if omitted.
        vocab_size: Vocabulary size; from the engine's model config if omitted.
        eos_token_ids: Token ids that end generation; from the tokenizer when omitted.
        weight_names: Names ``update_weights`` accepts. None: the checkpoint's, read from the
            engine's model path (no check, with a warning, when it cannot be read).
        image_token_id: The image placeholder's id of a vision-language model; from the engine's
            model config (or the checkpoint's ``config.json``) when omitted. With one the
            instance declares ``capabilities.vision``.
        enable_memory_saver: Build the engine with SGLang's memory saver, so ``sleep`` frees GPU
            memory (only when ``engine`` is None; it is fixed when an engine is created).
        flush_timeout_s: How long ``update_weights``/``sleep`` retry ``flush_cache`` while
            SGLang's scheduler is busy (e.g. serving another client) before giving up.
        **engine_kwargs: Passed to ``sglang.Engine`` when ``engine`` is None. Without ``dtype``, a
            float32 checkpoint runs in float32 (SGLang's own ``"auto"`` would run it in float16;
            see :mod:`agentloop_engines.adapters.dtypes`).

    Attributes:
        max_model_len: The most prompt + generated tokens SGLang serves: ``context_len - 2``, or
            ``max_req_input_len + 4`` when SGLang's KV pool is smaller than the context.
        max_prompt_len: ``max_req_input_len - 1``: the longest prompt SGLang accepts.
        per_request_seed: Whether ``SamplingParams.seed`` is honoured (SGLang's
            ``enable_deterministic_inference``); when False, seeded sampling does not reproduce.
        image_token_id: The image placeholder's id of a vision-language model (None: text only).

    Raises:
        ImportError: when ``engine`` is None and SGLang is not installed.
        ValueError: when a size cannot be read from the engine and was not given.
    """

    capabilities = SGLANG_ENGINE.capabilities.server  # declared once, on the plug-in record

    def __init__(self, engine: Any | None = None, *, model_path: str | None = None, tokenizer: Any = None,
                 context_len: int | None = None, max_req_input_len: int | None = None,
                 vocab_size: int | None = None, eos_token_ids: Iterable[int] | None = None,
                 weight_names: Iterable[str] | None = None, image_token_id: int | None = None,
                 enable_memory_saver: bool = False, flush_timeout_s: float = 30.0, **engine_kwargs: Any) -> None:
        if engine is None:
            if model_path is None:
                raise ValueError("SGLangServer needs an engine or a model_path")
            sglang = _require_sglang()
            if engine_kwargs.get("dtype") is None:  # SGLang's "auto" runs a float32 checkpoint in float16
                engine_kwargs.pop("dtype", None)
                dtype = default_engine_dtype(model_path)
                if dtype is not None:
                    engine_kwargs["dtype"] = dtype
            engine = sglang.Engine(model_path=model_path, enable_memory_saver=enable_memory_saver,
                                   **engine_kwargs)
        elif engine_kwargs or enable_memory_saver:
            given = sorted(engine_kwargs) + (["enable_memory_saver"] if enable_memory_saver else [])
            raise ValueError(f"{given} are only used when engine is None; create the engine with them")
        self.engine: Any = engine  # an sglang.Engine, or an object with the same surface
        tm = getattr(engine, "tokenizer_manager", None)
        args = getattr(engine, "server_args", None)
        self.context_len = int(context_len or getattr(tm, "context_len", 0) or 0)
        self.max_req_input_len = int(max_req_input_len or getattr(tm, "max_req_input_len", 0) or 0)
        self.vocab_size = int(vocab_size or getattr(getattr(tm, "model_config", None), "vocab_size", 0) or 0)
        if not (self.context_len > 2 and self.max_req_input_len and self.vocab_size):
            raise ValueError("could not read context_len/max_req_input_len/vocab_size from the engine; "
                             "pass them to SGLangServer")
        # SGLang cuts new tokens to max_req_len - prompt - 1, where max_req_len is
        # min(context_len, KV pool) - 1 and max_req_input_len is max_req_len - 5.
        self.max_model_len = min(self.context_len - 2, self.max_req_input_len + 4)
        self.max_prompt_len = self.max_req_input_len - 1  # SGLang refuses len >= max_req_input_len
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = tuple(int(t) for t in (eos_token_ids or ()))
        saver = bool(getattr(args, "enable_memory_saver", False))
        path = model_path or getattr(args, "model_path", None)
        vision = sglang_vision(getattr(tm, "model_config", None), checkpoint_config(str(path) if path else None),
                               image_token_id, self.vocab_size)
        self.image_token_id, self._patch_size = vision.image_token_id, vision.patch_size
        self.banned_token_ids = vision.banned_token_ids
        """Ids never sampled: a vision model's image/video placeholders (empty: text only)."""
        # Declared per instance: sleep needs the memory saver, images a vision-language model.
        self.capabilities = replace(type(self).capabilities, sleep=saver, vision=self.image_token_id is not None)
        self.per_request_seed = bool(getattr(args, "enable_deterministic_inference", False))
        specs: dict[str, WeightSpec] | None = None
        if weight_names is None:
            specs = _checkpoint_specs(str(path)) if path else None
            if specs is None:
                logger.warning("SGLangServer cannot read the checkpoint's weights from %r; "
                               "update_weights will not catch misspelt names or wrong shapes", path)
        else:
            specs = dict.fromkeys(weight_names, WeightSpec(None, None))
        self.weight_specs = specs
        """What ``update_weights`` checks an update against (the checkpoint's names, shapes and
        dtype kinds), or None: no check."""
        self.weight_names = None if specs is None else frozenset(specs)
        self.flush_timeout_s = flush_timeout_s
        self._loop_thread = EngineLoopThread(self.engine.loop, name="sglang-engine-loop")
        # Blocking control calls wait here, not on the default executor, which other code on the
        # loop (sync agents, reward functions) may fill.
        self._control_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-sglang-control")
        self._rids: dict[str, set[str]] = {}
        self._seq = itertools.count()
        self._seed_warned = False
        # Admission state, changed only on the caller's event loop; see _exclusive.
        self._inflight = 0
        self._exclusive_held = False
        self._asleep = False
        self._aborted: set[str] = set()
        self._waiters: list[asyncio.Future[None]] = []

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, model: Any = None, tokenizer: Any = None) -> SGLangServer:
        """The ``sglang`` plug-in's factory: an engine built from ``config.model_path`` with the
        record's fields under SGLang's names (:data:`CONFIG_ARGUMENTS`; ``enable_prefix_caching``
        as ``disable_radix_cache``, inverted), then ``engine_kwargs``.

        Args:
            config: What to build.
            model: Not used (SGLang loads the checkpoint itself).
            tokenizer: A tokenizer, or a path to one (loaded here: the adapter needs its EOS id).
        """
        del model
        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer or config.tokenizer_path or config.model_path)
        # SGLang's switch is the inverse of the record's (``disable_radix_cache``); engine_kwargs still win.
        arguments = {"disable_radix_cache": not config.enable_prefix_caching, **config.arguments(CONFIG_ARGUMENTS)}
        return cls(model_path=config.model_path, tokenizer=tokenizer, **arguments)

    # ---- admission: requests wait while a weight update or sleep holds the engine ---------------

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Hold new requests back and wait until ours have finished."""
        await self._wait_until(lambda: not self._exclusive_held)
        self._exclusive_held = True
        try:
            await self._wait_until(lambda: self._inflight == 0)
            yield
        finally:
            self._exclusive_held = False
            self._wake()

    async def _flush_when_idle(self) -> None:
        """Flush the cache, retrying while SGLang's scheduler still counts a request as running
        (one loop pass after it returned, or another client's); a bounded wait, then an error."""
        deadline, delay = time.monotonic() + self.flush_timeout_s, 0.005
        while True:
            result = await self._control("flush_cache")
            ok = getattr(result, "success", result)
            if ok is None or ok:  # None: an SGLang whose flush_cache reports nothing
                return
            if time.monotonic() + delay > deadline:
                raise RuntimeError(
                    f"SGLang's flush_cache kept failing for {self.flush_timeout_s:g} s: its scheduler is "
                    "still busy (requests from another client?). Not updating weights or releasing "
                    "memory, which would kill the engine (SGLang asserts it is idle)"
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.5)

    # ---- generation -----------------------------------------------------------------------

    def validate_request(
        self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | SamplingParams | None
    ) -> SamplingParams:
        """:meth:`AsyncServerBase.validate_request`, and a ValueError for a prompt of
        ``max_req_input_len`` tokens or more (SGLang refuses it, with an error that names neither
        the request nor a fix)."""
        if prompt_ids is not None and len(prompt_ids) >= self.max_req_input_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but SGLang refuses prompts of max_req_input_len="
                f"{self.max_req_input_len} tokens or more (context {self.context_len}): shorten it to at most "
                f"{self.max_prompt_len} tokens, or start SGLang with a longer context_length (in training: "
                "actor_rollout_ref.rollout.max_model_len) and enough KV cache (mem_fraction_static)"
            )
        return super().validate_request(prompt_ids, sampling_params)

    def _engine_sampling_params(self, sp: SamplingParams) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,  # SGLang disables top-k with -1 only
            "stop_token_ids": list(sp.stop_token_ids),  # ignored by SGLang under ignore_eos: cut later
            "ignore_eos": sp.ignore_eos,
        }
        if self.banned_token_ids:  # a vision model's placeholders: never sampled
            params["logit_bias"] = sglang_logit_bias(self.banned_token_ids)
        if sp.seed is not None and self.per_request_seed:
            params["sampling_seed"] = sp.seed
        elif sp.seed is not None and sp.temperature > 0 and not self._seed_warned:
            self._seed_warned = True
            logger.warning("SGLang ignores per-request seeds unless the engine runs with "
                           "enable_deterministic_inference=True; seeded sampling will not reproduce")
        return params

    def _image_data(self, prompt_ids: list[int], images: tuple[ImageItem, ...]) -> dict[str, Any]:
        """``async_generate``'s image keyword: the images at the size the rendering processor
        resized them to (see the module doc); nothing for a text prompt.

        Raises:
            ValueError: when the prompt's image tokens are not the images' expansions.
            CapabilityNotSupportedError: for a tiled image (several runs; HFServer serves those).
        """
        if not images:
            return {}
        assert self.image_token_id is not None  # AsyncServerBase refuses images without the capability
        refuse_tiled_images(images, type(self).__name__)  # SGLang fills one run per image
        image_token_runs(prompt_ids, images, self.image_token_id)
        return {"image_data": [self._as_processed(item) for item in images]}

    def _as_processed(self, item: ImageItem) -> Any:
        grid = item.features.get("image_grid_thw")
        if grid is None or self._patch_size is None:
            return item.image
        size = (int(grid[0][2]) * self._patch_size, int(grid[0][1]) * self._patch_size)
        if tuple(item.image.size) == size:
            return item.image
        from PIL import Image  # pyright: ignore[reportMissingImports] - images are PIL images: Pillow is here

        # Bicubic: Qwen-VL's resample; the processor resized the image exactly so (pixel values
        # of the resized image through the processor are the original's, bit for bit).
        return item.image.resize(size, resample=Image.Resampling.BICUBIC)

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                        images: tuple[ImageItem, ...] = ()) -> TokenOutput:
        image_data = self._image_data(prompt_ids, images)
        # SGLang rids must be unique among live requests; a trajectory's request_id may have
        # several requests in flight (n > 1 sampling), so suffix a counter and abort them all.
        rid = f"{request_id}#{next(self._seq)}"
        self._rids.setdefault(request_id, set()).add(rid)
        try:
            await self._wait_until(lambda: rid in self._aborted or not (self._exclusive_held or self._asleep))
            if rid in self._aborted:  # aborted while held back by an update or sleep
                return TokenOutput([], [] if sp.logprobs else None, "aborted")
            self._inflight += 1
            try:
                out = await self._loop_thread.run(self.engine.async_generate(
                    input_ids=list(prompt_ids), sampling_params=self._engine_sampling_params(sp),
                    return_logprob=True, rid=rid, **image_data,
                ))
            finally:
                self._inflight -= 1
                self._wake()
        finally:
            self._aborted.discard(rid)
            self._rids[request_id].discard(rid)
            if not self._rids[request_id]:
                del self._rids[request_id]
        return self._to_token_output(out, sp)

    @staticmethod
    def _to_token_output(out: Any, sp: SamplingParams) -> TokenOutput:
        if isinstance(out, list):  # a batch of one
            out = out[0]
        meta = out.get("meta_info", {})
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise RuntimeError("SGLang returned no output_token_logprobs although return_logprob=True")
        ids = [int(p[1]) for p in pairs]
        if "output_ids" in out and list(out["output_ids"]) != ids:
            raise RuntimeError(
                f"SGLang's output_ids {list(out['output_ids'])[:8]}... differ from the ids in "
                f"output_token_logprobs {ids[:8]}...; refusing to guess which tokens were sampled"
            )
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        reason = _FINISH.get(kind or "length")
        if reason is None:
            raise RuntimeError(f"unknown SGLang finish_reason {finish!r}")
        if sp.ignore_eos and sp.stop_token_ids:
            cut = next((i for i, t in enumerate(ids) if t in sp.stop_token_ids), None)
            if cut is not None:
                pairs, ids, reason = pairs[: cut + 1], ids[: cut + 1], "stop"
        log_probs = [float(p[0]) for p in pairs] if sp.logprobs else None
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason=reason,  # type: ignore[arg-type]
                           extra={"sglang_finish_reason": finish})

    async def abort(self, request_id: str) -> None:
        """Abort every live SGLang request of ``request_id``; each returns ``'aborted'``."""
        abort = getattr(self.engine, "abort_request", None) or self.engine.tokenizer_manager.abort_request
        for rid in list(self._rids.get(request_id, ())):
            self._aborted.add(rid)
            # abort_request is synchronous but touches loop-owned state: run it on that loop.
            self._loop_thread.call_soon(lambda r=rid: abort(rid=r))
        self._wake()

    # ---- control --------------------------------------------------------------------------

    async def _control(self, name: str, **kwargs: Any) -> Any:
        method = getattr(self.engine, name)
        if inspect.iscoroutinefunction(method):
            return await self._loop_thread.run(method(**kwargs))
        return await asyncio.get_running_loop().run_in_executor(
            self._control_pool, functools.partial(self._loop_thread.call_paused, method, **kwargs))

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights in place, with the prefix cache flushed (stale KV would mix policies):
        new requests wait and running ones finish, so none runs between the flush and the update.

        The whole update is checked against :attr:`weight_specs` first: SGLang's loader skips
        unknown names silently and copies the rest, and a wrong shape fails midway.

        Raises:
            WeightUpdateError: (a ValueError) naming every tensor with a name the checkpoint does
                not have, a wrong shape or a dtype of another kind; nothing was sent to SGLang.
            RuntimeError: when SGLang reports the update failed, or stays busy past ``flush_timeout_s``.
        """
        items = list(named_tensors)
        if self.weight_specs is not None:
            items = check_weight_update(items, self.weight_specs, engine="the SGLang checkpoint")
        async with self._exclusive():
            if self._asleep:
                raise RuntimeError("SGLang's weights are released while asleep; call wake_up() first")
            await self._flush_when_idle()
            result = await self._control("update_weights_from_tensor", named_tensors=items, flush_cache=False)
        ok, message = (result[0], result[1]) if isinstance(result, tuple) else (
            getattr(result, "success", True), getattr(result, "message", ""))
        if not ok:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {message}")

    def _require_memory_saver(self) -> None:
        if not self.capabilities.sleep:
            raise CapabilityNotSupportedError(
                "SGLang frees memory on sleep only with its memory saver: create the engine with "
                "enable_memory_saver=True (SGLangServer(model_path=..., enable_memory_saver=True))"
            )

    async def sleep(self) -> None:
        """Release GPU memory (weights and KV cache) until :meth:`wake_up`; requests wait.

        Raises:
            CapabilityNotSupportedError: when the engine runs without the memory saver.
            RuntimeError: when SGLang stays busy past ``flush_timeout_s``.
        """
        self._require_memory_saver()
        async with self._exclusive():
            if self._asleep:
                return
            await self._flush_when_idle()
            await self._control("release_memory_occupation")
            self._asleep = True

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released and serve the requests that waited."""
        self._require_memory_saver()
        async with self._exclusive():
            if self._asleep:
                await self._control("resume_memory_occupation")
                self._asleep = False

    async def close(self) -> None:
        """Stop the loop thread and shut the engine down."""
        self._loop_thread.close()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(self._control_pool, shutdown)
