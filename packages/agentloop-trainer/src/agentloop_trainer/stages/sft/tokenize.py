"""SFT conversations as the ids a rollout would hold, with the rollout's own machinery.

A conversation is built with :class:`agentloop_core.tokenization.Trajectory`, exactly as the
``tool_agent`` loop builds a rollout: the prompt (messages before the first assistant turn)
rendered with the generation prompt, each assistant turn appended as if an engine had generated
it (mask 1), and the tool results and user turns after it appended as the template's delta
(mask 0). So the loss covers what the engine generates (an assistant turn through the token
that ends it) and nothing else: not the prompt, not the tool results, not the template's glue
after the end-of-turn token.

The ids of an assistant turn are the ones the model must generate to produce it: the text the
template renders for that message after the generation prompt, encoded, and cut after the first
token an engine stops on (EOS, the template's end-of-turn token, the tool parser's stop tokens).
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizedConversation:
    """A conversation as ids with a loss mask."""

    input_ids: list[int]
    """All token ids, prompt included."""
    loss_mask: list[int]
    """1 on assistant-generated tokens (trained), 0 elsewhere."""
    images: tuple[Any, ...] = ()
    """The conversation's images (``ImageItem``\\ s, processed once) in the order of their tokens."""

    @property
    def trained_tokens(self) -> int:
        """Tokens that carry loss (the first token is never predicted, so it never counts)."""
        return sum(self.loss_mask[1:])

    def assistant_turns(self) -> list[list[int]]:
        """The ids of each assistant turn (each run of loss-mask 1), in order: what an engine
        must generate, turn by turn, for a rollout to reproduce this conversation."""
        turns: list[list[int]] = []
        previous = 0
        for token, m in zip(self.input_ids, self.loss_mask, strict=True):
            if m and not previous:
                turns.append([])
            if m:
                turns[-1].append(token)
            previous = m
        return turns


class SFTTokenizer:
    """Tokenizes SFT conversations the way the ``tool_agent`` loop builds rollouts.

    One :class:`~agentloop_core.tokenization.ChatRenderer` per distinct tool list (and chat
    template) is built and reused, as the loops reuse their construction probes.

    Args:
        tokenizer: Hugging Face tokenizer with a chat template (load it with
            ``assets.load_tokenizer(cfg)`` so ``model.custom_chat_template`` applies).
        stop_token_ids: Ids an engine stops on besides EOS and the template's end-of-turn token
            (the tool parser's stop tokens, ``<|eot_id|>``...).
        apply_chat_template_kwargs: Template variables, as the rollout passes them.
        vision: The model's :class:`~agentloop_core.vision.VisionProcessor` (None: text only):
            image parts of the conversations become image tokens, as in the rollout.
    """

    def __init__(self, tokenizer: Any, stop_token_ids: Iterable[int] = (),
                 apply_chat_template_kwargs: Mapping[str, Any] | None = None, vision: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vision = vision
        self.extra_stop_ids = tuple(int(i) for i in stop_token_ids)
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self._renderers: dict[tuple[str, str], Any] = {}
        self._checked: set[tuple] = set()
        self._warned_tools: set[str] = set()

    def renderer(self, tools: list[dict] | None) -> Any:
        """The renderer for ``tools`` (built once per tool list and template)."""
        from agentloop_core.tokenization import ChatRenderer

        key = self._key(tools)
        renderer = self._renderers.get(key)
        if renderer is None:
            renderer = self._renderers[key] = ChatRenderer(
                self.tokenizer, tools=tools or None, apply_chat_template_kwargs=self.apply_chat_template_kwargs,
                vision=self.vision)
        return renderer

    def _key(self, tools: list[dict] | None) -> tuple[str, str]:
        return json.dumps(tools, sort_keys=True, default=str), str(getattr(self.tokenizer, "chat_template", ""))

    def stop_ids(self, renderer: Any) -> frozenset[int]:
        """Ids that end a generated turn: EOS, the template's end-of-turn token, the extras."""
        ids = {renderer.eos_token_id, getattr(self.tokenizer, "eos_token_id", None), *self.extra_stop_ids}
        return frozenset(i for i in ids if isinstance(i, int))

    def tokenize(self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None,
                 check: bool | None = None) -> TokenizedConversation:
        """Ids and loss mask of one conversation.

        Args:
            messages: Chat messages: a prompt (system/user...), then assistant turns with the
                tool results or user turns between them; the last one an assistant turn.
            tools: Tool schemas rendered into the prompt, as the rollout renders them.
            check: Compare the result with a re-tokenization of the whole conversation (the
                rollout's strict sanity check). None: once per conversation shape (roles, tool
                list, template), which is what can change the rendering's structure. That each
                assistant turn renders as an extension of its history is checked always.

        Raises:
            ValueError: the conversation is malformed, an assistant turn renders differently
                after its history than its generation prompt implies, it has no stop token,
                the template drops its tool calls, or the result disagrees with the template.
        """
        from agentloop_core.protocol import TokenOutput
        from agentloop_core.tokenization import Trajectory

        messages = [dict(m) for m in messages]
        roles = [str(m.get("role")) for m in messages]
        if "assistant" not in roles:
            raise ValueError("an SFT conversation needs at least one assistant turn (the tokens it trains)")
        if roles[-1] != "assistant":
            raise ValueError("the last message of an SFT conversation must be an assistant turn (messages "
                             "after it are never trained; drop them)")
        first = roles.index("assistant")
        if first == 0:
            raise ValueError("an SFT conversation must start with a prompt (a system or user message), not an "
                             "assistant turn")
        renderer = self.renderer(tools)
        shape = (tuple(roles), tuple(bool(m.get("tool_calls")) for m in messages), self._key(tools))
        if check is None:
            check = shape not in self._checked
        stops = self.stop_ids(renderer)
        trajectory = Trajectory(renderer, messages[:first])
        if tools:
            self._warn_if_tools_ignored(renderer, tools, messages[:first])
        i = first
        while i < len(messages):
            ids = self._turn_ids(renderer, messages, i, stops)
            trajectory.append_generated(TokenOutput(token_ids=ids, stop_reason="stop"))
            calls = messages[i].get("tool_calls")
            if calls:
                trajectory.attach_tool_calls([_wire_call(c) for c in calls])
            j = next((k for k in range(i + 1, len(messages)) if roles[k] == "assistant"), len(messages))
            if j == i + 1 and j < len(messages):
                raise ValueError(f"messages {i} and {j} are both assistant turns; a rollout puts a tool result or "
                                 "a user turn between two assistant turns (merge them)")
            if j > i + 1:
                trajectory.append_messages(messages[i + 1 : j])
            i = j
        if check:
            report = trajectory.sanity_check("strict")
            if not report.ok:
                raise ValueError("the SFT tokenization disagrees with a re-tokenization of the conversation by the "
                                 f"chat template: {report.describe()}")
            self._checked.add(shape)
        prompt = list(trajectory.prompt_ids)
        return TokenizedConversation(prompt + list(trajectory.response_ids),
                                     [0] * len(prompt) + list(trajectory.response_mask), tuple(trajectory.image_items))

    def _turn_ids(self, renderer: Any, messages: list[dict], i: int, stops: frozenset[int]) -> list[int]:
        """The ids an engine generates for assistant message ``i``: the template's text for it
        after the generation prompt, through the first stop token."""
        before = renderer.render_text(messages[:i], add_generation_prompt=True)
        after = renderer.render_text(messages[: i + 1], add_generation_prompt=False)
        if not after.startswith(before):
            raise ValueError(
                f"the chat template does not render message {i} as an extension of the history; delta "
                "tokenization needs a prefix-stable template (the generation prompt, then what the model "
                "writes); set model.custom_chat_template to one that is")
        turn = after[len(before):]
        calls = messages[i].get("tool_calls") or []
        missing = [n for n in (_call_name(c) for c in calls) if n and n not in turn]
        if missing:
            raise ValueError(
                f"the chat template does not render the tool_calls of message {i} (no {missing[0]!r} in the "
                "rendered turn), so the model would learn an empty turn; set model.custom_chat_template to a "
                "template that renders assistant tool_calls (e.g. hermes <tool_call> blocks)")
        ids = renderer.encode(turn)
        end = next((k for k, t in enumerate(ids) if t in stops), None)
        if end is None:
            raise ValueError(
                f"assistant message {i} does not end with a stop token (EOS {self.tokenizer.eos_token!r} or the "
                f"template's end of turn {renderer.eos_text!r}); the model would never learn to stop")
        return ids[: end + 1]

    def _warn_if_tools_ignored(self, renderer: Any, tools: list[dict], prompt: list[dict]) -> None:
        """Log once per template when the prompt shows none of the tool names: the model is
        then trained without seeing the schemas (the rollout's tool loop would refuse it)."""
        template = str(getattr(self.tokenizer, "chat_template", ""))
        if template in self._warned_tools:
            return
        self._warned_tools.add(template)
        text = renderer.render_text(prompt, add_generation_prompt=True)
        names = [_call_name(t) for t in tools]
        if names and not any(n and n in text for n in names):
            logger.warning("the chat template ignores tools=: SFT prompts do not show the tool schemas %s (the "
                           "tool_agent loop refuses such a template); set model.custom_chat_template to a template "
                           "that renders tools", names)


def _call_name(call: Any) -> str | None:
    if not isinstance(call, Mapping):
        return None
    spec = call.get("function", call)
    return spec.get("name") if isinstance(spec, Mapping) else None


def _wire_call(call: Mapping[str, Any]) -> dict:
    """A call in the form the ``tool_agent`` loop attaches it: arguments as a JSON string."""
    spec = dict(call.get("function", call))
    args = spec.get("arguments", {})
    out = {"type": "function", "function": {"name": spec.get("name"),
                                            "arguments": args if isinstance(args, str) else json.dumps(args)}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


_SHARED: weakref.WeakKeyDictionary[Any, SFTTokenizer] = weakref.WeakKeyDictionary()


def shared_tokenizer(tokenizer: Any) -> SFTTokenizer:
    """One :class:`SFTTokenizer` per tokenizer object (so its renderers and checks are reused)."""
    try:
        found = _SHARED.get(tokenizer)
        if found is None:
            found = _SHARED[tokenizer] = SFTTokenizer(tokenizer)
        return found
    except TypeError:  # not weakly referenceable
        return SFTTokenizer(tokenizer)


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None = None,
                          check_prefix: bool = True) -> TokenizedConversation:
    """Tokenize a conversation with a mask on assistant turns (see :class:`SFTTokenizer`).

    Args:
        tokenizer: Hugging Face tokenizer with a chat template.
        messages: Chat messages; the last one must be an assistant turn.
        tools: Tool schemas rendered into the system turn.
        check_prefix: Also check the result against the template's rendering of the whole
            conversation (what a rollout generates is what SFT trains); conversations of one
            shape need it once.

    Raises:
        ValueError: as :meth:`SFTTokenizer.tokenize`.
    """
    return shared_tokenizer(tokenizer).tokenize(messages, tools, check=check_prefix)
