"""``HFServer``: any Hugging Face causal LM behind the token-level ``AsyncServer`` API.

A single scheduler task per event loop collects the requests that are waiting (up to
``max_batch_size``, after a short ``batch_wait_s`` for stragglers), decodes them together in a
worker thread (see :mod:`agentloop_engines.adapters.hf.batch`), and hands each result back as soon as
that row stops. Requests that arrive while a batch runs form the next batch.

The worker thread is the server's own (one per server: its model work runs one step at a time
anyway), never the event loop's default executor: other code on the loop (a synchronous agent,
a reward function, any ``asyncio.to_thread``) can take every thread of that one, and then the
engine, which they may be waiting on, could not run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import random
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from agentloop_core.engine_registry import EngineConfig
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.vision.processor import ImageItem
from agentloop_engines.base import AsyncServerBase
from agentloop_engines.plugins import HF_ENGINE
from agentloop_engines.streaming import OnTokens, TokenDelta, queued_stream

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('HFServer needs torch and transformers: pip install "agentloop-engines[hf]"') from exc

from agentloop_engines.adapters.hf.attention import use_grouped_decode_attention
from agentloop_engines.adapters.hf.batch import DecodeBatch, Row
from agentloop_engines.adapters.hf.model_setup import eos_token_ids, torch_dtype
from agentloop_engines.adapters.hf.packed_linear import pack_linears
from agentloop_engines.adapters.hf.prefix_cache import PrefixCache
from agentloop_engines.adapters.hf.sampling import RowSampling
from agentloop_engines.adapters.hf.vision import (
    image_token_id,
    linear_patch_embeddings,
    load_model,
    text_config,
)
from agentloop_engines.adapters.hf.weights import load_weights_in_place
from agentloop_engines.adapters.placeholders import placeholder_token_ids

_CONFIG_ARGUMENTS = {name: name for name in ("device", "dtype", "max_batch_size", "max_model_len", "seed",
                                              "enable_prefix_caching")}
"""The :class:`~agentloop_core.engine_registry.EngineConfig` fields HFServer takes (same names)."""
_STAT_KEYS = ("forward_calls", "batched_rows", "max_batch_rows", "batches", "prefill_tokens", "generated_tokens",
              "shared_prefix_tokens", "repeated_prompt_tokens", "image_prefill_fallbacks", *PrefixCache.STAT_KEYS)


def _resolve(fut: asyncio.Future, out: TokenOutput) -> None:
    if not fut.done():
        fut.set_result(out)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class HFServer(AsyncServerBase):
    """Batched generation with a plain ``transformers`` model, on CPU or CUDA.

    Log-probs are ``log_softmax(logits / T)`` of the sampled token (``T = 1`` for greedy),
    before top-k/top-p filtering, over the vocabulary less a vision model's placeholder ids
    (banned from sampling): what a trainer recomputes (:mod:`agentloop_engines.adapters.hf.sampling`).

    ``sleep()`` drops the prefix cache, moves the weights to the CPU and empties the CUDA cache;
    requests wait until ``wake_up()``. A CPU server without a prefix cache frees nothing, so
    ``capabilities.sleep`` is False there, but ``sleep``/``wake_up`` still work (requests wait)
    and leave outputs unchanged.

    Args:
        model_path_or_model: A checkpoint folder or hub id (loaded with
            ``AutoModelForCausalLM.from_pretrained``), or a model object.
        tokenizer: A tokenizer, a path to one, or None to load it from the checkpoint folder
            (stays None for a model object; an HTTP server in front of it then has no ``/v1`` routes).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``. None: float32
            for a path, the object's own dtype for a model object.
        max_batch_size: Most requests decoded together.
        max_model_len: Context length (prompt + generated). None: the config's
            ``max_position_embeddings``.
        batch_wait_s: How long the scheduler waits for more requests after the first arrives.
        seed: Seeds the RNG that picks per-request seeds for requests without one.
        grouped_attention: For a model with grouped key/value heads on ``sdpa`` attention,
            compute decode steps per key/value head instead of repeating the cache for every
            query head (:mod:`agentloop_engines.adapters.hf.attention`; same tokens, log-probs equal to
            ~1e-5). False keeps the model's attention as loaded.
        packed_linear: On CPU in float32, run the linear layers through oneDNN with weights
            packed once (:mod:`agentloop_engines.adapters.hf.packed_linear`: 2-3x MKL's speed on AMD
            CPUs, one more copy of the weights in memory; repacked when a weight changes).
        enable_prefix_caching: Keep each ``request_id``'s last turn's KV cache and prefill only a
            next turn's new tokens (:mod:`agentloop_engines.adapters.hf.prefix_cache`; exact). On
            a CPU server ``sleep`` then frees it (``capabilities.sleep``).
        prefix_cache_tokens: The cache's bound in tokens over all trajectories; None: as many as
            :data:`~agentloop_engines.adapters.hf.prefix_cache.DEFAULT_PREFIX_CACHE_BYTES` hold.

    Attributes:
        stats: Counters: ``forward_calls``, ``batched_rows`` (sum of rows over forward calls),
            ``max_batch_rows``, ``batches``, ``prefill_tokens``, ``generated_tokens``,
            ``shared_prefix_tokens`` (not recomputed: a prefix every prompt of a prefill shares),
            ``repeated_prompt_tokens`` (not recomputed: prompts repeated in one prefill, such
            as a GRPO group's samples), ``image_prefill_fallbacks`` (batched prefills with images
            that failed and were retried row by row).
        batch_sizes: Number of requests in each of the last 1000 batches.
    """

    capabilities = HF_ENGINE.capabilities.server  # declared on the plug-in record, which imports without torch

    def __init__(
        self,
        model_path_or_model: str | Path | Any,
        tokenizer: Any | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        batch_wait_s: float = 0.002,
        seed: int | None = None,
        grouped_attention: bool = True,
        packed_linear: bool = True,
        enable_prefix_caching: bool = True,
        prefix_cache_tokens: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but torch.cuda.is_available() is False; use device='cpu'")
        resolved = torch_dtype(dtype)
        # Any causal LM: a transformers model or the caller's own object (transformers' annotation
        # of ``PreTrainedModel.to`` rejects a device); None once closed, which every entry point
        # checks first (``_ensure_scheduler``).
        self.model: Any
        if isinstance(model_path_or_model, (str, Path)):
            path = str(model_path_or_model)
            self.model = load_model(path, resolved or torch.float32)
            if tokenizer is None:
                tokenizer = path
            self.model_name = path
        else:
            self.model = model_path_or_model
            if resolved is not None:
                self.model = self.model.to(resolved)
            self.model_name = getattr(self.model.config, "_name_or_path", None) or type(self.model).__name__
        if isinstance(tokenizer, (str, Path)):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        self.model = self.model.to(self.device).eval()
        self.grouped_attention = bool(grouped_attention) and use_grouped_decode_attention(self.model)
        """Whether decode steps use :func:`~agentloop_engines.adapters.hf.attention.grouped_decode_sdpa`."""
        self.packed_linears = pack_linears(self.model, max_batch_size) if packed_linear else 0
        """How many linear layers run through oneDNN with packed weights (0: none)."""
        linear_patch_embeddings(self.model)  # Qwen-VL's patch Conv3d as a matmul (hf/vision.py)

        config = text_config(self.model)
        self.image_token_id = image_token_id(self.model)
        """The image placeholder's id of a vision-language model (None: text only)."""
        self.batch_image_prefill = True
        """Prefill prompts with images that arrive together in one forward (False: one by one)."""
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.banned_token_ids = placeholder_token_ids(self.model.config, self.vocab_size)
        """A vision model's image/video placeholder ids, never sampled (empty: text only)."""
        limit = getattr(config, "max_position_embeddings", None)
        if max_model_len is None:
            if limit is None:
                raise ValueError("the model config has no max_position_embeddings; pass max_model_len=")
            max_model_len = int(limit)
        elif limit is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}; "
                "lower it or leave it None"
            )
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1000)
        self.prefix_cache = PrefixCache.for_model(self.model, enable_prefix_caching, prefix_cache_tokens, self.stats)
        # Declared per instance: sleep frees memory on CUDA, or a CPU server's prefix cache;
        # images need a vision model.
        self.capabilities = replace(type(self).capabilities, vision=self.image_token_id is not None,
                                    sleep=self.device.type == "cuda" or self.prefix_cache is not None,
                                    prefix_cache=self.prefix_cache is not None,
                                    forget_session=self.prefix_cache is not None)
        self._seeds = random.Random(seed)
        self._pending: list[Row] = []
        self._by_id: dict[str, set[Row]] = collections.defaultdict(set)
        self._asleep = False
        self._draining = 0
        self._closed = False
        self.steps_per_hop = 8
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        # Every prefill, decode step, merge, weight load and offload runs here (see the module docstring).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-hf-engine")

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, model: Any = None, tokenizer: Any = None) -> HFServer:
        """The ``hf`` plug-in's factory: the engine ``config`` describes.

        Args:
            config: Its ``device``, ``dtype``, ``max_batch_size``, ``max_model_len``, ``seed`` and
                ``enable_prefix_caching`` become this class's arguments of those names, then
                ``engine_kwargs`` (which win).
            model: An in-memory model to serve (a copy of the policy) instead of loading
                ``config.model_path``.
            tokenizer: A tokenizer or a path to one (see the class).
        """
        return cls(model if model is not None else config.model_path, tokenizer,
                   **config.arguments(_CONFIG_ARGUMENTS))

    def _ensure_scheduler(self) -> None:
        if self._closed:
            raise RuntimeError("HFServer is closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not loop:
            # Requests queued on a previous (now finished) event loop can never be awaited again.
            self._pending.clear()
            self._by_id.clear()
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._awake = asyncio.Event()
            self._engine_lock = asyncio.Lock()
            if not self._asleep:
                self._awake.set()
        self._task = loop.create_task(self._scheduler(), name="HFServer.scheduler")

    async def _in_engine_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the server's own thread (never the default executor) and await it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    # ---- generation --------------------------------------------------------------------

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                        images: tuple[ImageItem, ...] = ()) -> TokenOutput:
        return await self._run(request_id, prompt_ids, sp, images=images)

    async def _generate_stream(self, request_id: str, prompt_ids: list[int],
                               sp: SamplingParams, images: tuple[ImageItem, ...] = ()) -> AsyncGenerator[TokenDelta, None]:
        # Each sampled token is handed to the loop by the decode thread; the batch itself runs
        # exactly as for a request answered whole.
        loop = asyncio.get_running_loop()

        def run(on_tokens: OnTokens) -> Awaitable[TokenOutput]:
            def on_token(tok: int, lp: float) -> None:
                loop.call_soon_threadsafe(on_tokens, [tok], [lp] if sp.logprobs else None)

            return self._run(request_id, prompt_ids, sp, on_token=on_token, images=images)

        async with contextlib.aclosing(queued_stream(run)) as deltas:
            async for delta in deltas:
                yield delta

    async def _run(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                   on_token: Callable[[int, float], object] | None = None,
                   images: tuple[ImageItem, ...] = ()) -> TokenOutput:
        self._ensure_scheduler()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TokenOutput] = loop.create_future()
        generator = None
        if sp.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sp.seed if sp.seed is not None else self._seeds.getrandbits(63))
        stop_ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        row = Row(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sp=sp,
            sampling=RowSampling(sp.temperature, sp.top_k, sp.top_p, generator, self.banned_token_ids),
            stop_ids=frozenset(stop_ids),
            on_done=lambda out: loop.call_soon_threadsafe(_resolve, fut, out),
            on_error=lambda exc: loop.call_soon_threadsafe(_fail, fut, exc),
            on_token=on_token,
            images=images,
        )
        self._pending.append(row)
        self._by_id[request_id].add(row)
        self._wakeup.set()
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller gave up: stop spending compute on it.
            row.aborted = True
            if row in self._pending:
                self._pending.remove(row)
            raise
        finally:
            rows = self._by_id.get(request_id)
            if rows is not None:
                rows.discard(row)
                if not rows:
                    del self._by_id[request_id]

    async def _scheduler(self) -> None:
        running: DecodeBatch | None = None
        while True:
            if running is None:
                await self._wakeup.wait()
                if self.batch_wait_s > 0:
                    await asyncio.sleep(self.batch_wait_s)
            await self._awake.wait()
            # The lock is held for a batch's whole life so weights never change under a
            # running request; a waiting update_weights/sleep stops admission so it drains.
            async with self._engine_lock:
                running = await self._admit(running)
                while running is not None:
                    try:
                        running = await self._in_engine_thread(self._decode, running)
                    except Exception as exc:  # noqa: BLE001 - delivered to every waiting caller
                        running.abort_all(exc)
                        running = None
                        break
                    if (self._pending and not self._draining and len(running or ()) < self.max_batch_size
                            and (running is None or running.can_merge())):
                        running = await self._admit(running)

    def _take_pending(self, room: int) -> list[Row]:
        if self.prefix_cache is not None and len(self._pending) > room:
            # Trajectories' next turns first, in arrival order, then new prompts (SGLang's
            # longest-prefix-match order, reduced to hit or miss): a next turn's entry waits in
            # the cache, and each new prompt admitted ahead of it grows the set of entries
            # waiting, until the bound evicts the oldest (the next to be admitted).
            self._pending[:] = self.prefix_cache.hits_first(self._pending)
        batch = self._pending[:room]
        del self._pending[:room]
        if not self._pending:
            self._wakeup.clear()
        return batch

    async def _admit(self, running: DecodeBatch | None) -> DecodeBatch | None:
        new = self._take_pending(self.max_batch_size - len(running or ()))
        if not new:
            return running
        self.stats["batches"] += 1
        self.batch_sizes.append(len(new))
        try:
            fresh = await self._in_engine_thread(
                DecodeBatch.prefill_all, self.model, new, pad_id=self.pad_id, device=self.device, stats=self.stats,
                image_token_id=self.image_token_id, batch_images=self.batch_image_prefill, prefix_cache=self.prefix_cache)
        except Exception as exc:  # noqa: BLE001 - delivered to the callers of this prefill
            for row in new:
                row.fail(exc)
            return running
        if running is None:
            return fresh
        if fresh is None:
            return running
        try:
            return await self._in_engine_thread(running.merge, fresh)
        except Exception as exc:  # noqa: BLE001 - both batches' callers must hear of it
            running.abort_all(exc)
            fresh.abort_all(exc)
            return None

    def _decode(self, batch: DecodeBatch) -> DecodeBatch | None:
        # Several steps per thread hop, but hand control back as soon as requests are waiting.
        running: DecodeBatch | None = batch
        for _ in range(self.steps_per_hop):
            running = batch.step(self.model, self.stats)
            if running is None or self._pending:
                break
            batch = running
        return running

    async def abort(self, request_id: str) -> None:
        """Stop every in-flight request with ``request_id``.

        Queued requests return at once with no tokens; running ones return within one decode
        step with the tokens generated so far. Both get ``stop_reason="aborted"``. Unknown ids
        are ignored (the request may have just finished).
        """
        for row in list(self._by_id.get(request_id, ())):
            row.aborted = True
            if row in self._pending:
                self._pending.remove(row)
                row.finish("aborted")

    def forget_session(self, request_id: str) -> None:
        """Drop the prefix-cache entry of ``request_id``, whose trajectory is over (thread-safe;
        unknown ids are ignored). A turn still running for it stores its entry when it
        finishes, and LRU ages that out."""
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request_id)

    # ---- weights and memory ------------------------------------------------------------

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """Copy new weights into the model in place, between batches.

        The whole update is checked first (every name, shape and dtype kind against the
        model's ``state_dict``), so a refused update changes nothing.

        Args:
            named_tensors: ``(name, tensor)`` pairs (or a mapping) using the model's
                ``state_dict`` names; tensors are cast to each parameter's device and dtype
                (within their kind: a floating weight takes any floating tensor).

        Raises:
            WeightUpdateError: (a ValueError and a KeyError) naming every tensor with an
                unknown name (and the closest names), a wrong shape or a dtype of another kind;
                nothing was loaded.
        """
        self._ensure_scheduler()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        # pyright narrows the Iterable[tuple] arm by isinstance(..., Mapping) to Mapping[tuple, Unknown]:
        items = cast("Iterable[tuple[str, Any]]", items)
        async with self._drained():
            await self._in_engine_thread(self._load_weights, items)

    @contextlib.asynccontextmanager
    async def _drained(self):
        """Hold the engine between batches: admission pauses until the running batch ends."""
        self._draining += 1
        try:
            async with self._engine_lock:
                yield
        finally:
            self._draining -= 1

    def _load_weights(self, items: Iterable[tuple[str, Any]]) -> None:
        load_weights_in_place(self.model, items, engine=f"{type(self).__name__}'s model")
        if self.prefix_cache is not None:  # keys and values of the old weights
            self.prefix_cache.clear()

    async def sleep(self) -> None:
        """Pause serving; on CUDA also move the weights to the CPU and free the CUDA cache."""
        self._ensure_scheduler()
        async with self._drained():
            self._asleep = True
            self._awake.clear()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            if self.device.type == "cuda":
                await self._in_engine_thread(self._offload)

    def _offload(self) -> None:
        self.model.to("cpu")
        torch.cuda.empty_cache()

    async def wake_up(self) -> None:
        """Restore the weights to the device and resume serving queued requests."""
        self._ensure_scheduler()
        async with self._engine_lock:
            if self._asleep and self.device.type == "cuda":
                await self._in_engine_thread(self.model.to, self.device)
            self._asleep = False
            self._awake.set()

    async def close(self) -> None:
        """Abort everything in flight, stop the scheduler and drop the model."""
        if self._closed:
            return
        for rows in list(self._by_id.values()):
            for row in list(rows):
                row.aborted = True
        for row in self._pending:
            row.finish("aborted")
        self._pending.clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is self._loop:
                # Let a running batch see the abort flags and return before cancelling.
                async with self._engine_lock:
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._closed = True
        self.model = None
        self._executor.shutdown(wait=False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

