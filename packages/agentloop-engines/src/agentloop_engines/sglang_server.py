"""``SGLangServer``: the token-level server API over an in-process ``sglang.Engine``.

The adapter calls only this part of the engine's surface:

* ``await engine.async_generate(input_ids=..., sampling_params={max_new_tokens, temperature,
  top_p, top_k, stop_token_ids, ignore_eos[, sampling_seed]}, return_logprob=True, rid=...)``
  returning ``{"output_ids", "meta_info": {"output_token_logprobs": [(logprob, id, ...)],
  "finish_reason": {"type": "stop" | "length" | "abort", ...}}}``, awaited on ``engine.loop``;
* ``engine.update_weights_from_tensor(named_tensors=...)``, ``engine.flush_cache()``,
  ``engine.release_memory_occupation()``, ``engine.resume_memory_occupation()``: synchronous
  (they run ``engine.loop.run_until_complete``) or coroutine functions;
* ``engine.tokenizer_manager.abort_request(rid=...)`` (or ``engine.abort_request``).

Needs the ``[sglang]`` extra and a GPU; the adapter logic is tested here against a stand-in.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Iterable
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_engines.base import AsyncServerBase
from agentloop_engines.engine_loop import EngineLoopThread

__all__ = ["SGLangServer"]

_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}


def _require_sglang() -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise ImportError('SGLangServer needs SGLang: pip install "agentloop-engines[sglang]"') from exc
    return sglang


class SGLangServer(AsyncServerBase):
    """Serve an SGLang engine (GPU) behind ``AsyncServerBase``.

    Args:
        engine: A started ``sglang.Engine`` (or an object with the same surface). None: one is
            built from ``model_path`` and ``engine_kwargs``.
        model_path: Model folder or hub id, used when ``engine`` is None.
        tokenizer: Hugging Face tokenizer, for ``chat_completion`` and EOS ids.
        max_model_len: Context length; read from the engine's tokenizer manager when omitted.
        vocab_size: Vocabulary size; read from the engine's model config when omitted.
        eos_token_ids: Token ids that end generation; from the tokenizer when omitted.
        **engine_kwargs: Passed to ``sglang.Engine`` when ``engine`` is None.

    Raises:
        ImportError: when ``engine`` is None and SGLang is not installed.
        ValueError: when a size cannot be read from the engine and was not given.
    """

    capabilities = ServerCapabilities(logprobs=True, sleep=True, weight_update=True, prefix_cache=True,
                                      chat_completion=True)

    def __init__(self, engine: Any | None = None, *, model_path: str | None = None, tokenizer: Any = None,
                 max_model_len: int | None = None, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] | None = None, **engine_kwargs: Any) -> None:
        if engine is None:
            if model_path is None:
                raise ValueError("SGLangServer needs an engine or a model_path")
            engine = _require_sglang().Engine(model_path=model_path, **engine_kwargs)
        elif engine_kwargs:
            raise ValueError(f"engine_kwargs {sorted(engine_kwargs)} are only used when engine is None")
        self.engine = engine
        tm = getattr(engine, "tokenizer_manager", None)
        self.max_model_len = int(max_model_len or getattr(tm, "context_len", 0) or 0)
        mc = getattr(tm, "model_config", None)
        self.vocab_size = int(vocab_size or getattr(mc, "vocab_size", 0) or 0)
        if not self.max_model_len or not self.vocab_size:
            raise ValueError(
                "could not read max_model_len/vocab_size from the engine; pass them to SGLangServer"
            )
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = tuple(int(t) for t in (eos_token_ids or ()))
        self._loop_thread = EngineLoopThread(engine.loop, name="sglang-engine-loop")
        self._rids: dict[str, set[str]] = {}
        self._seq = itertools.count()

    # ---- generation -----------------------------------------------------------------------

    def _engine_sampling_params(self, sp: SamplingParams) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,  # SGLang disables top-k with -1 only
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": sp.ignore_eos,
        }
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        return params

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        # SGLang rids must be unique among live requests; a trajectory's request_id may have
        # several requests in flight (n > 1 sampling), so suffix a counter and abort them all.
        rid = f"{request_id}#{next(self._seq)}"
        self._rids.setdefault(request_id, set()).add(rid)
        try:
            out = await self._loop_thread.run(self.engine.async_generate(
                input_ids=list(prompt_ids), sampling_params=self._engine_sampling_params(sp),
                return_logprob=True, rid=rid,
            ))
        finally:
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
        log_probs = [float(p[0]) for p in pairs] if sp.logprobs else None
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason=reason,  # type: ignore[arg-type]
                           extra={"sglang_finish_reason": finish})

    async def abort(self, request_id: str) -> None:
        """Abort every live SGLang request of ``request_id``; each returns ``'aborted'``."""
        abort = getattr(self.engine, "abort_request", None) or self.engine.tokenizer_manager.abort_request
        for rid in list(self._rids.get(request_id, ())):
            # abort_request is synchronous but touches loop-owned state: run it on that loop.
            self._loop_thread.call_soon(lambda r=rid: abort(rid=r))

    # ---- control --------------------------------------------------------------------------

    async def _control(self, name: str, **kwargs: Any) -> Any:
        method = getattr(self.engine, name)
        if inspect.iscoroutinefunction(method):
            return await self._loop_thread.run(method(**kwargs))
        return await asyncio.to_thread(self._loop_thread.call_paused, method, **kwargs)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights in place, then flush the prefix cache (stale KV would mix policies).

        Raises:
            RuntimeError: when SGLang reports the update failed.
        """
        result = await self._control("update_weights_from_tensor", named_tensors=list(named_tensors))
        ok, message = (result[0], result[1]) if isinstance(result, tuple) else (
            getattr(result, "success", True), getattr(result, "message", ""))
        if not ok:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {message}")
        await self._control("flush_cache")

    async def sleep(self) -> None:
        """Release GPU memory (weights and KV cache) until :meth:`wake_up`."""
        await self._control("flush_cache")
        await self._control("release_memory_occupation")

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released."""
        await self._control("resume_memory_occupation")

    async def close(self) -> None:
        """Stop the loop thread and shut the engine down."""
        self._loop_thread.close()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)
