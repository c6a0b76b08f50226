"""Deliberately broken implementations; test_broken_impls.py checks the suite catches each one
with the right check. Each is a factory for the no-code options."""

from __future__ import annotations

from typing import Any

from segment_loops import SummarisingLoop

from agentloop_conformance import EngineTarget, hf_named_weights, hf_reference_log_probs
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer


def _hf_target(cls_body: dict[str, Any]) -> EngineTarget:
    from agentloop_engines.hf import HFServer
    from agentloop_engines.tiny_model import build_tiny_model

    cls = type("BrokenHFServer", (HFServer,), cls_body)
    server = cls(build_tiny_model(initializer_range=0.3), max_model_len=1024)
    return EngineTarget(server, hf_reference_log_probs(server.model), hf_named_weights(server.model))


def wrong_logprobs_engine() -> EngineTarget:
    """Log-probs shifted by -0.3: still valid-looking (finite, <= 0), but not the model's."""

    async def _generate(self, request_id, prompt_ids, sp):
        out = await super(type(self), self)._generate(request_id, prompt_ids, sp)
        if out.log_probs is None:
            return out
        return TokenOutput(out.token_ids, [lp - 0.3 for lp in out.log_probs], out.stop_reason, out.extra)

    return _hf_target({"_generate": _generate})


def ignores_stop_engine() -> EngineTarget:
    """Drops the request's stop_token_ids."""

    async def _generate(self, request_id, prompt_ids, sp):
        return await super(type(self), self)._generate(request_id, prompt_ids, sp.replace(stop_token_ids=()))

    return _hf_target({"_generate": _generate})


class ReencodingLoop(AgentLoopBase):
    """Single turn, but decodes the generated ids and trains on their re-encoding."""

    async def run(self, sampling_params, **row):
        text = self.tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = await self.server.generate("reencode", prompt_ids, sampling_params)
        ids = self.tokenizer.encode(self.tokenizer.decode(out.token_ids), add_special_tokens=False)
        lps = list(out.log_probs or [])[: len(ids)]
        lps += [0.0] * (len(ids) - len(lps))
        return AgentLoopOutput(prompt_ids, ids, [1] * len(ids), lps, num_turns=2)


def reencoding_loop(server: Any) -> ReencodingLoop:
    return ReencodingLoop(server, load_tiny_tokenizer(), {"response_length": 64})


class UnsharedRewardLoop(SummarisingLoop):
    """Segments right, but each segment scored on its own: the trajectory has no one reward."""

    def segments(self, builder, num_turns):
        outs = super().segments(builder, num_turns)
        for k, out in enumerate(outs):
            out.reward_score = float(k)
        return outs


def unshared_reward_loop(server: Any) -> UnsharedRewardLoop:
    return UnsharedRewardLoop(server, load_tiny_tokenizer(), {"response_length": 64})


class NewlineDroppingTokenizer:
    """Wraps a tokenizer; its encode drops a newline right after the end-of-turn token."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._newline = inner.encode("\n", add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._inner.encode(text, add_special_tokens=add_special_tokens)
        eos = self._inner.eos_token_id
        out: list[int] = []
        for tid in ids:
            if out and out[-1] == eos and [tid] == self._newline:
                continue
            out.append(tid)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def newline_dropping_tokenizer() -> NewlineDroppingTokenizer:
    return NewlineDroppingTokenizer(load_tiny_tokenizer())


class ParallelCallsCrashingTokenizer:
    """Wraps a tokenizer; its apply_chat_template (Python code, not the template) raises
    TypeError on an assistant turn with several tool calls: a bug, not a template refusal."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> Any:
        if any(len(m.get("tool_calls") or []) > 1 for m in conversation):
            raise TypeError("'NoneType' object is not iterable")
        return self._inner.apply_chat_template(conversation, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def parallel_calls_crashing_tokenizer() -> ParallelCallsCrashingTokenizer:
    return ParallelCallsCrashingTokenizer(load_tiny_tokenizer())
