"""What a generation says as a chat choice: its message, reasoning and tool calls.

The tool-call and reasoning parsers read the generated text; a parser whose markup is made of
special tokens (harmony's ``<|call|>``, gpt-oss reasoning channels) reads it decoded with
special tokens kept, which the response text erases. :class:`ChatOutput` builds that text, splits
off the reasoning, formats the parsed calls as OpenAI ``tool_calls`` and assembles the choice
(with vLLM's ``stop_reason``: the stop string that ended the generation, which the Messages API
reports as its ``stop_sequence``); the streamed path
(:mod:`~agentloop_engines.serving.gateway.live`) formats its calls with the same
:meth:`ChatOutput.format_calls`, so a stream and a whole answer carry the same call ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.parsers import ParseResult, ToolParser
from agentloop_core.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser, ReasoningSplit
from agentloop_engines.serving.gateway.generation import FINISH_REASONS, Generation
from agentloop_engines.serving.gateway.openai_request import ChatRequest
from agentloop_engines.serving.gateway.stop import single_token_stop_ids

__all__ = ["ChatOutput"]


class ChatOutput:
    """The parsers' view of a generation.

    Args:
        tokenizer: The tokenizer that decodes the generated ids.
        parser: The tool-call parser; None: no calls are parsed.
        reasoning: The reasoning parser; None: no reasoning is split off.
    """

    def __init__(self, tokenizer: Any, parser: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tokenizer = tokenizer
        self.parser = parser
        self.reasoning = reasoning
        special = getattr(tokenizer, "all_special_ids", None) or ()
        self._special_ids = frozenset(int(i) for i in special)
        parser_stops = parser.stop_tokens if parser is not None else ()
        self._parser_stop_ids = frozenset(single_token_stop_ids(tokenizer, parser_stops))

    def choice(self, gen: Generation, req: ChatRequest) -> dict[str, Any]:
        """The ``chat.completion`` choice of ``gen``: its assistant message (the reasoning split
        off, the tool calls parsed when ``req`` asks for them), its finish reason, logprobs and
        the exact-token extension fields. Decodes: run it off the event loop."""
        message: dict[str, Any] = {"role": "assistant", "content": gen.text}
        finish = FINISH_REASONS[gen.stop_reason]
        choice: dict[str, Any] = {"index": 0, "message": message}
        split = None
        if self.reasoning is not None:
            split = self.split_reasoning(gen)
            message["content"] = self.reasoning.visible_content(split.content)
            if split.reasoning:
                message["reasoning_content"] = split.reasoning
        if req.parse_tool_calls and self.parser is not None:
            assert req.tools is not None
            calls, errors, content = self.tool_calls(gen, req.tools, req.messages, split)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = calls
                # A reply cut at max_tokens stays "length" (its calls may be followed by a cut one).
                finish = "tool_calls" if finish == "stop" else finish
            if errors:
                choice["tool_call_errors"] = errors
        choice["logprobs"] = None
        if req.logprobs and gen.log_probs is not None:
            choice["logprobs"] = {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(self.token_texts(gen.token_ids), gen.log_probs, strict=True)]}
        choice["finish_reason"] = finish
        choice["stop_reason"] = gen.stop  # vLLM's field: the stop string that ended it, else None
        choice["token_ids"] = gen.token_ids
        choice["token_logprobs"] = gen.log_probs
        return choice

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone, special tokens kept (the logprobs' ``token`` strings)."""
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def parser_text(self, gen: Generation, special: bool) -> str:
        """The generation as a parser reads it: the response text, or with ``special`` (call or
        reasoning markup made of special tokens, erased from the response text) decoded with
        special tokens kept, minus a token that only ended the turn (EOS) but keeping the tool
        parser's own stop token (harmony's <|call|> closes the call)."""
        if not special:
            return gen.text
        ids = gen.token_ids
        if ids and gen.stop_reason == "stop" and ids[-1] in self._special_ids and ids[-1] not in self._parser_stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        if gen.stop is not None and gen.stop in text:
            text = text[: text.rindex(gen.stop)]
        return text

    def split_reasoning(self, gen: Generation) -> ReasoningSplit:
        """The generation split by the reasoning parser, decoded as the tool parser reads it."""
        assert self.reasoning is not None
        special, in_reasoning = self._reasoning_reading(gen.prompt_ids)
        return self.reasoning.split(self.parser_text(gen, special), in_reasoning=in_reasoning)

    def _reasoning_reading(self, prompt_ids: Sequence[int]) -> tuple[bool, bool]:
        """``(special, in_reasoning)``: whether the reasoning parser reads the text with special
        tokens kept, and whether the generation starts inside reasoning (the prompt's tail opened it)."""
        assert self.reasoning is not None
        special = self.reasoning.needs_special_tokens or (self.parser is not None and self.parser.needs_special_tokens)
        in_reasoning = False
        if self.reasoning.reads_prompt:
            tail = self.tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
            in_reasoning = self.reasoning.starts_in_reasoning(tail)
        return special, in_reasoning

    def reasoning_tokens(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """How many of the generated ``token_ids`` are reasoning: the shortest start of them whose
        split holds the whole reasoning, closed (all of them when the reasoning never closed; 0
        without a reasoning parser or reasoning). A usage count, never a training input. Decodes
        (a binary search over the starts): run it off the event loop."""
        parser = self.reasoning
        if parser is None or not token_ids:
            return 0
        special, in_reasoning = self._reasoning_reading(prompt_ids)

        def split(n: int) -> ReasoningSplit:
            text = self.tokenizer.decode(list(token_ids[:n]), skip_special_tokens=not special)
            return parser.split(text, in_reasoning=in_reasoning)

        whole = split(len(token_ids))
        if not whole.reasoning or not whole.closed:
            return 0 if not whole.reasoning else len(token_ids)
        low, high = 1, len(token_ids)
        while low < high:
            mid = (low + high) // 2
            part = split(mid)
            if part.closed and part.reasoning == whole.reasoning:
                high = mid
            else:
                low = mid + 1
        return low

    def tool_calls(self, gen: Generation, tools: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]],
                   split: ReasoningSplit | None = None) -> tuple[list[dict], list[dict], str]:
        """The calls in the generation (in ``split.content`` when a reasoning parser split it)
        of the request's ``tools``, the parse errors, and the content around the calls."""
        assert self.parser is not None
        text = split.content if split is not None else self.parser_text(gen, self.parser.needs_special_tokens)
        parsed = self.parser.parse(text, {t["function"]["name"]: t for t in tools})
        calls = self.format_calls(parsed, messages)
        errors = [{"raw": e.raw, "reason": e.reason, "kind": e.kind, "name": e.name} for e in parsed.errors]
        return calls, errors, parsed.content

    def format_calls(self, parsed: ParseResult, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Parsed calls as OpenAI ``tool_calls``, their ids unique in the conversation ``messages``."""
        assert self.parser is not None
        # The turn is the number of assistant messages so far + 1.
        turn = 1 + sum(m.get("role") == "assistant" for m in messages)
        return [{"id": call.model_id or self.parser.make_call_id(turn, i, call), "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                for i, call in enumerate(parsed.calls)]
