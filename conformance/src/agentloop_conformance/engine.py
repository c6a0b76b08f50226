"""Engine conformance tests: subclass :class:`EngineConformanceTests` (or pick the mixins) and
define one fixture, ``engine``, that starts the engine and stops it after the tests.

Every test docstring says what the engine must do and how to debug a failure.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import pytest

from agentloop_conformance.engine_fixtures import EngineFixtures, greedy
from agentloop_conformance.engine_vision import EngineVisionTests
from agentloop_conformance.hooks import copy_tensor, perturb_tensor

__all__ = [
    "EngineConcurrencyTests",
    "EngineConformanceTests",
    "EngineFixtures",
    "EngineGenerationTests",
    "EngineLogProbTests",
    "EngineMemoryTests",
    "EngineVisionTests",
    "greedy",
]


class EngineGenerationTests(EngineFixtures):
    """Greedy determinism, valid ids, token budgets, stop tokens, clear errors."""

    __conformance_suite__ = True

    async def test_greedy_is_deterministic(self, engine: Any) -> None:
        """Greedy decoding (temperature 0) returns the same ids for the same prompt, alone or
        batched with other requests. Debug: look for non-deterministic kernels, padding that
        leaks into attention, or a sampler that ignores temperature 0."""
        prompts = self.prompts(engine)
        alone = [self.check_output(await engine.generate(f"det-a{i}", p, greedy(self.max_tokens)), "greedy")
                 for i, p in enumerate(prompts)]
        batched = await asyncio.gather(*(engine.generate(f"det-b{i}", p, greedy(self.max_tokens))
                                         for i, p in enumerate(prompts)))
        for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
            assert a.token_ids == b.token_ids, (
                f"prompt {i}: greedy output differs between a lone request and a batched one:\n"
                f"  alone:   {a.token_ids}\n  batched: {b.token_ids}")

    async def test_token_ids_in_vocabulary(self, engine: Any) -> None:
        """Every generated id lies in ``[0, vocab_size)`` when sampling at temperature 1.
        Debug: an id past the tokenizer's vocabulary usually means padded embedding rows are
        not masked out of the logits."""
        v = self.vocab_size(engine)
        outs = await asyncio.gather(*(engine.generate(f"vocab{i}", p, {"max_tokens": self.max_tokens, "temperature": 1.0,
                                                                      "seed": i, "logprobs": False})
                                      for i, p in enumerate(self.prompts(engine))))
        for out in outs:
            bad = [t for t in self.check_output(out, "sampling").token_ids
                   if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v]
            assert not bad, f"ids outside [0, {v}) or not plain ints: {bad[:10]}"

    @pytest.mark.parametrize("budget", [1, 7])
    async def test_max_tokens_respected(self, engine: Any, budget: int) -> None:
        """With ``ignore_eos`` the engine returns exactly ``max_tokens`` ids and
        ``stop_reason="length"``. Debug: check an off-by-one in the decode loop."""
        out = self.check_output(await engine.generate("budget", self.prompts(engine)[0], greedy(budget)), "budget")
        assert len(out.token_ids) == budget, f"asked for {budget} tokens, got {len(out.token_ids)}"
        assert out.stop_reason == "length", f"stop_reason is {out.stop_reason!r}, expected 'length'"

    async def test_stop_token_ids_honoured(self, engine: Any) -> None:
        """A request's ``stop_token_ids`` end generation at the first stop token, which IS
        included in ``token_ids`` (the agentloop contract), with ``stop_reason="stop"``.
        Debug: compare with the free-running output printed in the failure."""
        prompt = self.prompts(engine)[1]
        free = self.check_output(await engine.generate("free", prompt, greedy(self.max_tokens)), "free run")
        stop = free.token_ids[3] if len(free.token_ids) > 3 else free.token_ids[-1]
        first = free.token_ids.index(stop)
        out = self.check_output(
            await engine.generate("stopped", prompt, greedy(self.max_tokens, stop_token_ids=[stop])), "stop run")
        expected = free.token_ids[: first + 1]
        assert out.token_ids == expected, (
            f"with stop_token_ids=[{stop}] expected {expected} (stop token included), got {out.token_ids}; "
            f"free run was {free.token_ids}")
        assert out.stop_reason == "stop", f"stop_reason is {out.stop_reason!r}, expected 'stop'"

    async def test_empty_prompt_is_a_value_error(self, engine: Any) -> None:
        """An empty prompt raises ValueError saying the prompt is empty (not a crash deep in the
        engine, not a hang)."""
        # The match tells the engine's own refusal from a ValueError raised further in.
        with pytest.raises(ValueError, match=r"(?i)empty|prompt"):
            await asyncio.wait_for(engine.generate("empty", [], greedy(4)), 30)

    async def test_overlong_prompt_is_a_value_error(self, engine: Any) -> None:
        """A prompt longer than the context (``max_model_len``) raises ValueError naming the
        lengths. Debug: validate the request before queueing it."""
        n = self.max_model_len(engine) + 8
        ids = self.prompts(engine)[0]
        prompt = (ids * (n // len(ids) + 1))[:n]
        with pytest.raises(ValueError, match=rf"\b{n}\b"):  # the prompt's length is named
            await asyncio.wait_for(engine.generate("overlong", prompt, greedy(4)), 30)


class EngineLogProbTests(EngineFixtures):
    """Log-probs: present, one per token, valid, and equal to a reference forward pass."""

    __conformance_suite__ = True

    @pytest.mark.parametrize("temperature", [0.0, 1.0])
    async def test_log_probs_present_and_valid(self, engine: Any, temperature: float) -> None:
        """With ``logprobs=True`` every generated id has one finite log-prob <= 0; with
        ``logprobs=False`` ``log_probs`` is None. Debug: log-probs must be of the sampled
        token, not of the whole distribution or the top-1 token."""
        if not self.capability(engine, "logprobs"):
            pytest.skip("engine declares capabilities.logprobs=False")
        params = {"max_tokens": self.max_tokens, "temperature": temperature, "seed": 3, "logprobs": True,
                  "ignore_eos": True}
        out = self.check_output(await engine.generate("lp", self.prompts(engine)[0], params), "logprobs")
        assert out.log_probs is not None, "logprobs=True but log_probs is None"
        assert len(out.log_probs) == len(out.token_ids), "one log-prob per generated token"
        bad = [lp for lp in out.log_probs if not (isinstance(lp, float) and math.isfinite(lp) and lp <= 1e-6)]
        assert not bad, f"log-probs must be finite floats <= 0, got {bad[:5]}"
        off = self.check_output(await engine.generate("nolp", self.prompts(engine)[0], {**params, "logprobs": False}), "")
        assert off.log_probs is None, "logprobs=False but log_probs was returned"

    @pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
    async def test_log_probs_match_reference(self, engine: Any, reference_log_probs: Any, temperature: float) -> None:
        """Each log-prob equals ``log_softmax(logits / T)`` of a plain forward pass over prompt +
        generated ids (T = 1 for greedy), within ``logprob_atol``: the number a trainer
        recomputes. Top-k/top-p filters only change which token is drawn; a vision model's
        placeholder ids, banned from sampling, are removed from the distribution (their logits
        at -inf), as :func:`~agentloop_conformance.hooks.hf_reference_log_probs` does. Debug: check temperature scaling, that log-probs are taken
        before top-k/top-p filtering, and position ids under left padding."""
        if not self.capability(engine, "logprobs"):
            pytest.skip("engine declares capabilities.logprobs=False")
        if reference_log_probs is None:
            pytest.skip("no reference_log_probs hook: override the `reference_log_probs` fixture "
                        "(agentloop_conformance.hooks.hf_reference_log_probs(model) for transformers models)")
        params = {"max_tokens": self.max_tokens, "temperature": temperature, "ignore_eos": True, "logprobs": True}
        prompts = self.prompts(engine)[:3]
        outs = await asyncio.gather(*(engine.generate(f"ref{i}", p, {**params, "seed": i}) for i, p in enumerate(prompts)))
        for prompt, out in zip(prompts, outs, strict=True):
            ref = list(reference_log_probs(prompt, out.token_ids, temperature))
            assert len(ref) == len(out.log_probs or []), "reference and engine disagree on the token count"
            worst = max((abs(a - b) for a, b in zip(out.log_probs, ref, strict=True)), default=0.0)
            assert worst <= self.logprob_atol, (
                f"T={temperature}: log-probs differ from the reference forward pass by up to {worst:.4g} "
                f"(allowed {self.logprob_atol}):\n  engine:    {[round(x, 4) for x in out.log_probs]}\n"
                f"  reference: {[round(x, 4) for x in ref]}")


class EngineConcurrencyTests(EngineFixtures):
    """Concurrent requests (distinct and shared request ids) and abort."""

    __conformance_suite__ = True

    async def test_concurrent_requests_with_distinct_ids(self, engine: Any) -> None:
        """Requests in flight together each get the output they would get alone. Debug: rows
        of a batch mixed up, or a KV cache shared between requests."""
        prompts = self.prompts(engine)
        alone = [await engine.generate(f"seq{i}", p, greedy(self.max_tokens)) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(engine.generate(f"con{i}", p, greedy(self.max_tokens))
                                          for i, p in enumerate(prompts)))
        for i, (a, b) in enumerate(zip(alone, together, strict=True)):
            assert a.token_ids == b.token_ids, f"prompt {i}: concurrent output differs from the sequential one"

    async def test_concurrent_requests_sharing_a_request_id(self, engine: Any) -> None:
        """Several requests with the SAME request id (one trajectory's turns, or n samples) in
        flight together each get their own output. Debug: an engine that keys its request table
        by request id alone overwrites or cross-wires them."""
        prompts = self.prompts(engine)
        alone = [await engine.generate(f"s{i}", p, greedy(self.max_tokens)) for i, p in enumerate(prompts)]
        shared = await asyncio.gather(*(engine.generate("shared-id", p, greedy(self.max_tokens)) for p in prompts))
        for i, (a, b) in enumerate(zip(alone, shared, strict=True)):
            assert a.token_ids == b.token_ids, f"prompt {i}: output under a shared request id differs"

    async def test_abort_returns_promptly(self, engine: Any) -> None:
        """``abort(request_id)`` makes a running request return within ``abort_timeout_s`` with
        ``stop_reason="aborted"`` and the tokens generated so far; the engine then serves new
        requests as before, and aborting an unknown id is not an error. Debug: the decode loop
        must check an abort flag every step."""
        prompt = self.prompts(engine)[0]
        before = await engine.generate("pre-abort", prompt, greedy(self.max_tokens))
        budget = min(self.abort_max_tokens, self.max_model_len(engine) - len(prompt) - 1)
        task = asyncio.ensure_future(engine.generate("abort-me", prompt, greedy(budget)))
        await asyncio.sleep(self.abort_delay_s)
        if task.done():
            out = task.result()
            pytest.fail(f"the request finished ({len(out.token_ids)} tokens, {out.stop_reason!r}) before abort "
                        "was sent; lower abort_delay_s or raise abort_max_tokens")
        await engine.abort("abort-me")
        try:
            out = await asyncio.wait_for(task, self.abort_timeout_s)
        except asyncio.TimeoutError:
            pytest.fail(f"aborted request did not return within {self.abort_timeout_s} s")
        assert out.stop_reason == "aborted", f"stop_reason is {out.stop_reason!r}, expected 'aborted'"
        assert len(out.token_ids) < budget, "aborted request still generated its whole budget"
        await engine.abort("no-such-request")
        after = await engine.generate("post-abort", prompt, greedy(self.max_tokens))
        assert after.token_ids == before.token_ids, "greedy output changed after an abort"


class EngineMemoryTests(EngineFixtures):
    """sleep/wake_up and in-place weight updates."""

    __conformance_suite__ = True

    async def _greedy_all(self, engine: Any, tag: str) -> list[list[int]]:
        outs = await asyncio.gather(*(engine.generate(f"{tag}{i}", p, greedy(self.max_tokens))
                                      for i, p in enumerate(self.prompts(engine))))
        return [o.token_ids for o in outs]

    async def test_sleep_wake_up_round_trip(self, engine: Any) -> None:
        """``sleep()`` then ``wake_up()`` leaves greedy outputs unchanged. Debug: weights or
        buffers not restored (dtype, device), or a prefix cache that survived with stale KV."""
        if not self.capability(engine, "sleep"):
            pytest.skip("engine declares capabilities.sleep=False")
        before = await self._greedy_all(engine, "sl-a")
        await engine.sleep()
        await engine.wake_up()
        after = await self._greedy_all(engine, "sl-b")
        assert after == before, "greedy outputs changed across sleep/wake_up"

    async def test_update_weights_changes_and_restores_output(self, engine: Any, named_weights: Any) -> None:
        """``update_weights`` with perturbed weights changes greedy output, and loading the
        original weights back restores it exactly. Debug: weights loaded into a copy, a prefix
        cache not reset after the update, or names/dtypes mapped wrongly."""
        if not self.capability(engine, "weight_update"):
            pytest.skip("engine declares capabilities.weight_update=False")
        if named_weights is None:
            pytest.skip("no named_weights hook: override the `named_weights` fixture to return the current "
                        "weights (agentloop_conformance.hooks.hf_named_weights(model) for torch models)")
        current: Mapping[str, Any] = named_weights()
        original = {name: copy_tensor(t) for name, t in current.items()}
        before = await self._greedy_all(engine, "w-a")
        perturbed = [(name, perturb_tensor(t, seed=i)) for i, (name, t) in enumerate(original.items())]
        await engine.update_weights(perturbed)
        changed = await self._greedy_all(engine, "w-b")
        await engine.update_weights(list(original.items()))
        restored = await self._greedy_all(engine, "w-c")
        assert changed != before, "greedy outputs did not change after loading perturbed weights"
        assert restored == before, "loading the original weights back did not restore the greedy outputs"


    async def test_forget_session_between_turns_keeps_outputs(self, engine: Any) -> None:
        """``forget_session(request_id)`` is a plain method that returns None at once (unknown
        ids included), and a trajectory's next turn after it gives the greedy output a fresh
        request gives. Debug: a coroutine function (the worker does not await it), or state
        dropped by half (a cache entry whose tokens went but whose keys stayed)."""
        if not self.capability(engine, "forget_session"):
            pytest.skip("engine declares capabilities.forget_session=False")
        assert engine.forget_session("fs-never-seen") is None, "forget_session must be a plain method returning None"
        prompt = self.prompts(engine)[0]
        first = await engine.generate("fs-a", prompt, greedy(self.max_tokens))
        following = list(prompt) + list(first.token_ids) + list(prompt[:3])
        assert engine.forget_session("fs-a") is None
        after = await engine.generate("fs-a", following, greedy(self.max_tokens))
        fresh = await engine.generate("fs-b", following, greedy(self.max_tokens))
        engine.forget_session("fs-a")
        engine.forget_session("fs-b")
        assert after.token_ids == fresh.token_ids, "greedy output of a turn after forget_session differs from a fresh request's"


class EngineConformanceTests(
    EngineGenerationTests, EngineLogProbTests, EngineConcurrencyTests, EngineMemoryTests, EngineVisionTests
):
    """Every engine check. Subclass it and define the ``engine`` fixture."""


