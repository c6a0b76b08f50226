"""Deliberately broken implementations; test_broken_impls.py checks the suite catches each one
with the right check. Each is a factory for the no-code options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from segment_loops import SummarisingLoop

from agentloop_conformance import EngineTarget, hf_named_weights, hf_reference_log_probs
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer


def _hf_target(cls_body: dict[str, Any]) -> EngineTarget:
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.testing.tiny_model import build_tiny_model

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


def async_forget_engine() -> EngineTarget:
    """``forget_session`` written as a coroutine function: the worker calls it without awaiting,
    so nothing is ever forgotten (and Python warns of a coroutine never awaited)."""

    async def forget_session(self, request_id):
        super(type(self), self).forget_session(request_id)

    return _hf_target({"forget_session": forget_session})


def ignores_images_engine() -> EngineTarget:
    """Serves the tiny Qwen2-VL but drops ``multi_modal_data``: the image tokens run as text, so
    every image is answered alike (and images that do not match the prompt go unnoticed)."""
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    async def _generate(self, request_id, prompt_ids, sp, images=()):
        return await super(type(self), self)._generate(request_id, prompt_ids, sp)

    cls = type("ImageBlindHFServer", (HFServer,), {"_generate": _generate})
    return EngineTarget(cls(build_tiny_vlm(initializer_range=0.3), max_model_len=1024))


def samples_placeholders_engine() -> EngineTarget:
    """Serves the tiny Qwen2-VL without banning its placeholder ids (``banned_token_ids``
    emptied), next to a copy whose top choice is the image placeholder."""
    from agentloop_conformance.placeholder_model import placeholder_preferring_checkpoint
    from agentloop_core.cache import build_once, cache_dir
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    folder = build_tiny_vlm(initializer_range=0.3)

    def build(out: Path) -> None:
        placeholder_preferring_checkpoint(folder, out)

    preferring = build_once(cache_dir() / f"{folder.name}-placeholder-preferring", build)
    servers = [HFServer(str(f), max_model_len=1024) for f in (folder, preferring)]
    for server in servers:
        server.banned_token_ids = ()
    return EngineTarget(servers[0], placeholder_engine=servers[1])


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


# -- broken copies of tool_agent and react_agent (each a no-code factory) ---------------------------
# Each copy is the real loop with one defect, run through the suite's own tool scenarios.


def _outputs(out: Any) -> list[AgentLoopOutput]:
    return out if isinstance(out, list) else [out]


class _PostProcessed:
    """Mixin: the loop runs normally, then ``damage`` edits each output it returns."""

    def damage(self, out: AgentLoopOutput) -> None:
        raise NotImplementedError

    async def run(self, sampling_params, **row):
        out = await super().run(sampling_params, **row)
        for o in _outputs(out):
            if not o.failed:
                self.damage(o)
        return out


class _MaskOneOnToolTokens(_PostProcessed):
    """Marks every response token, tool results and template glue included, as generated."""

    def damage(self, out):
        out.response_mask = [1] * len(out.response_ids)


class _MaskZeroOnAGeneratedToken(_PostProcessed):
    """Masks out the last generated token of the trajectory (its log-prob zeroed to match)."""

    def damage(self, out):
        last = max(i for i, m in enumerate(out.response_mask) if m == 1)
        out.response_mask[last] = 0
        if out.response_logprobs is not None:
            out.response_logprobs[last] = 0.0


class _LogProbsOffByOne(_PostProcessed):
    """Each generated token carries the log-prob of the token after it."""

    def damage(self, out):
        if out.response_logprobs is None:
            return
        where = [i for i, m in enumerate(out.response_mask) if m == 1]
        kept = [out.response_logprobs[i] for i in where]
        for i, lp in zip(where, [*kept[1:], kept[-1]], strict=True):
            out.response_logprobs[i] = lp


class _ReencodingServer:
    """Hands the loop the re-encoding of what the engine generated (as a loop that decodes and
    re-encodes generated text would train on)."""

    def __init__(self, inner: Any, tokenizer: Any) -> None:
        self._inner, self._tokenizer = inner, tokenizer

    async def generate(self, request_id, prompt_ids, sampling_params):
        out = await self._inner.generate(request_id, prompt_ids, sampling_params)
        ids = self._tokenizer.encode(self._tokenizer.decode(out.token_ids), add_special_tokens=False)
        lps = None
        if out.log_probs is not None:
            lps = list(out.log_probs)[: len(ids)] + [-0.5] * max(0, len(ids) - len(out.log_probs))
        return TokenOutput(ids, lps, out.stop_reason, out.extra)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Reencoding:
    def __init__(self, server, tokenizer, config=None, **kwargs):
        super().__init__(_ReencodingServer(server, tokenizer), tokenizer, config, **kwargs)


class _OverBudget:
    """Enforces a budget 300 tokens above the configured ``response_length`` (its config says
    one budget, its run uses another)."""

    async def run(self, sampling_params, **row):
        import dataclasses

        configured = self.config
        self.config = dataclasses.replace(configured, response_length=configured.response_length + 300)
        try:
            return await super().run(sampling_params, **row)
        finally:
            self.config = configured


class _ToolAgentDroppingToolResults:
    """tool_agent that never appends tool results (the model generates again right after its call)."""

    def _append(self, run, trajectory, new_messages):
        from agentloop_tools.agent_loop import AgentState

        if all(m.get("role") == "tool" for m in new_messages):
            return AgentState.GENERATING
        return super()._append(run, trajectory, new_messages)


def _dropping_chat_model():
    from agentloop_langgraph.chat_model import ChatModel

    class DroppingChatModel(ChatModel):
        """Leaves tool messages out of the trajectory the model sees."""

        def _extend(self, session, messages, tools, tools_key):
            trajectory = session.trajectory
            append = trajectory.append_messages

            def without_tool_results(chats):
                kept = [c for c in chats if c.get("role") != "tool"]
                return append(kept) if kept else []

            trajectory.append_messages = without_tool_results
            try:
                super()._extend(session, messages, tools, tools_key)
            finally:
                del trajectory.append_messages

    return DroppingChatModel


class _ReactAgentDroppingToolResults:
    def chat_model(self, sampling_params, request_id):
        model = super().chat_model(sampling_params, request_id)
        object.__setattr__(model, "__class__", _dropping_chat_model())
        return model


DEFECTS = {"mask_one_on_tool_tokens": _MaskOneOnToolTokens, "mask_zero_on_a_generated_token": _MaskZeroOnAGeneratedToken,
           "log_probs_off_by_one": _LogProbsOffByOne, "reencoded_responses": _Reencoding, "budget_overflow": _OverBudget}


def _broken(loop: str, defect: str) -> Any:
    from loop_factories import _config

    if loop == "env_agent":
        from loop_factories import env_config

        from agentloop_tools.env_agent import EnvAgentLoop
        # The environment's tool results go through tool_agent's _append too.
        mixin = _ToolAgentDroppingToolResults if defect == "dropped_tool_result" else DEFECTS[defect]
        cls = type(f"Broken_{loop}_{defect}", (mixin, EnvAgentLoop), {})
        return lambda server: cls(server, load_tiny_tokenizer(), env_config())
    if loop == "tool_agent":
        from agentloop_tools import ToolAgentLoop as base
        mixin = _ToolAgentDroppingToolResults if defect == "dropped_tool_result" else DEFECTS[defect]
    else:
        from agentloop_langgraph import ReactAgentLoop as base
        mixin = _ReactAgentDroppingToolResults if defect == "dropped_tool_result" else DEFECTS[defect]
    cls = type(f"Broken_{loop}_{defect}", (mixin, base), {})
    return lambda server: cls(server, load_tiny_tokenizer(), _config())


def __getattr__(name: str) -> Any:
    """``broken_impls:<loop>__<defect>`` (``tool_agent__budget_overflow``, ``env_agent__...``) is that broken
    copy's factory."""
    loop, sep, defect = name.partition("__")
    if sep and loop in ("tool_agent", "react_agent", "env_agent") and (defect in DEFECTS or defect == "dropped_tool_result"):
        return _broken(loop, defect)
    raise AttributeError(name)
