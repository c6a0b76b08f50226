"""One trajectory as token ids: generated tokens verbatim (mask 1), everything else rendered by
the chat template as a delta (mask 0)."""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import TokenOutput
from agentloop_core.tokenization.incremental import canonical_by_turn, snapshot, turn_encoder
from agentloop_core.tokenization.renderer import ChatRenderer, DeltaResult, TokenizationMismatchError
from agentloop_core.tokenization.sanity import SanityCheckMode, SanityCheckReport, check_mode, compare
from agentloop_core.tokenization.template_errors import raised_by_template, template_refusal

logger = logging.getLogger(__name__)

_PieceKind = Literal["prompt", "generated", "appended"]


@dataclass
class _Piece:
    kind: _PieceKind
    """prompt: the first render; generated: one generate call's ids; appended: glue + new
    messages + generation prompt."""
    text: str
    """The text these ids stand for (decoded text for generated pieces)."""
    n_ids: int
    """How many ids of prompt_ids + response_ids this piece covers."""
    ended: bool = True
    """Generated pieces: whether the engine ended the turn on a stop token."""
    digest: bytes | tuple[int, ...] = ()
    """A digest of the ids this piece appended, as appended (:func:`ids_digest`): the check
    compares the trajectory's ids with it. A digest, not a copy, so a trajectory in flight
    holds its ids once."""


class _PieceIds(NamedTuple):
    """A piece with its ids, as :func:`canonical_by_turn` reads it."""

    kind: str
    text: str
    ids: Sequence[int]


def ids_digest(ids: Sequence[int]) -> bytes | tuple[int, ...]:
    """A 128-bit BLAKE2 digest of ``ids`` (as 64-bit integers); the ids themselves as a tuple
    where they are not all such integers."""
    try:
        packed = array("q", ids).tobytes()
    except (TypeError, OverflowError):
        return tuple(ids)
    return hashlib.blake2b(packed, digest_size=16).digest()


class Trajectory:
    """Builds prompt_ids/response_ids/response_mask/logprobs for one trajectory.

    Generated ids are appended verbatim and never re-encoded; their decoded text (special
    tokens kept, a trailing end-of-turn token removed) becomes the assistant message content in
    :attr:`messages`, so later renders of the history contain exactly what the model wrote.
    Keep that message as it is: adding ``tool_calls`` to it makes the template render the calls
    a second time, which the sanity check reports; keep parsed calls elsewhere.

    The engine-view sanity check renders the prompt and, after each generated turn, the
    delta over the whole history. Renders this trajectory already made with exactly those
    inputs are reused instead of rendered a second time (see :meth:`_render_once`).

    Args:
        renderer: Renders and tokenizes messages.
        messages: The prompt messages (copied).
        sanity_check: The check :meth:`to_output` will run, when the caller knows it. With
            ``strict`` or ``ignore_strippable`` and the engine view
            (``use_inference_chat_template=False``), deltas of a renderer whose
            ``delta_strategy`` is ``auto`` are rendered over the whole history, as the check
            renders them, so the check reuses them instead of rendering each a second time
            (the ids are the same: ``auto`` uses the short render only where it agrees with
            this one). None or ``disable``: deltas follow the renderer's ``delta_strategy``.
    """

    def __init__(self, renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], *,
                 sanity_check: SanityCheckMode | None = None) -> None:
        if not messages:
            raise ValueError("a trajectory needs at least one prompt message")
        if sanity_check is not None:
            check_mode(sanity_check)
        self.renderer = renderer
        self.messages: list[dict] = [_check_message(m, i) for i, m in enumerate(messages)]
        """Text history; assistant content is the decoded generated text, verbatim."""
        self._rendered: dict[tuple[bytes, Any], str] = {}
        """Texts of the prompt and history-delta renders made so far, by a digest of everything
        the render read (see :meth:`_render_once`)."""
        self._history_deltas = renderer.delta_strategy == "history" or (
            renderer.delta_strategy == "auto" and sanity_check in ("strict", "ignore_strippable")
            and not renderer.use_inference_chat_template)
        """Whether deltas are rendered over the whole history (and kept for the check)."""
        text = self._render_prompt(self.messages)
        self.prompt_ids: list[int] = renderer.encode(text)
        """The rendered prompt with generation prompt: the first generate input."""
        self.response_ids: list[int] = []
        """Generated ids (mask 1) interleaved with rendered glue/tool/user ids (mask 0)."""
        self.response_mask: list[int] = []
        """1 for engine-generated ids, 0 for all other ids."""
        self.response_logprobs: list[float] | None = None
        """Engine log-prob per response id (0.0 on mask 0); None until an engine returns some."""
        self.num_generations = 0
        """How many generate outputs were appended."""
        self._pieces: list[_Piece] = [_Piece("prompt", text, len(self.prompt_ids), digest=ids_digest(self.prompt_ids))]
        self._snapshots: list[bytes | None] = [snapshot(m) for m in self.messages]
        """A digest of each message as JSON when it was appended: the check's proof that it is unchanged."""
        self._call_snapshots: dict[int, bytes | None] = {}
        self._settings = self._settings_snapshot()
        self._generated_messages: list[int] = []
        self._tool_calls: dict[int, list[dict]] = {}
        self._preview: tuple[tuple, DeltaResult] | None = None
        self._last_ended_with_eos = True

    @property
    def context_ids(self) -> list[int]:
        """prompt_ids + response_ids: the next ``generate`` input."""
        return self.prompt_ids + self.response_ids

    # -- building --------------------------------------------------------------------------

    def append_generated(self, out: TokenOutput) -> dict:
        """Append one ``generate`` output with mask 1 and its log-probs.

        Args:
            out: The engine's output for :attr:`context_ids`.

        Returns:
            The assistant message appended to :attr:`messages` (content = decoded text without
            the trailing end-of-turn token).

        Raises:
            ValueError: when the engine returned log-probs for some turns but not others.
        """
        ids = list(out.token_ids)
        if out.log_probs is not None:
            if self.response_logprobs is None:
                if any(self.response_mask):
                    raise ValueError(
                        "the engine returned log-probs for this turn but not for earlier ones; "
                        "request logprobs on every generate call of a trajectory"
                    )
                self.response_logprobs = [0.0] * len(self.response_ids)
            self.response_logprobs.extend(float(lp) for lp in out.log_probs)
        elif self.response_logprobs is not None and ids:
            raise ValueError(
                "the engine returned no log-probs for this turn but did for earlier ones; "
                "request logprobs on every generate call of a trajectory"
            )
        self.response_ids.extend(ids)
        self.response_mask.extend([1] * len(ids))
        text = self.renderer.decode(ids)
        ended = self.renderer.ended_turn(ids, out.stop_reason)
        stop_text = self.renderer.decode(ids[-1:]) if ended else ""
        content = text[: -len(stop_text)] if stop_text and text.endswith(stop_text) else text
        message = {"role": "assistant", "content": content}
        self.messages.append(message)
        self._snapshots.append(snapshot(message))
        self._generated_messages.append(len(self.messages) - 1)
        self._pieces.append(_Piece("generated", text, len(ids), ended, ids_digest(ids)))
        self._last_ended_with_eos = ended
        self._preview = None
        self.num_generations += 1
        return message

    def attach_tool_calls(self, tool_calls: Sequence[Mapping[str, Any]]) -> None:
        """Record the tool calls parsed from the last generated turn (OpenAI form: ``id``,
        ``function.name``, ``function.arguments``).

        They are never rendered as the turn's text (its ids are the engine's); templates that
        render a tool result only after the call it answers (gpt-oss names the function in the
        result's header, Mistral checks ids and role alternation) get them in delta renders.
        Without them, the ``name`` and ``tool_call_id`` of the tool messages stand in.

        Raises:
            ValueError: before any generated turn.
        """
        if not self._generated_messages:
            raise ValueError("attach_tool_calls needs a generated turn to attach the calls to")
        turn = self._generated_messages[-1]
        calls = self._tool_calls[turn] = [dict(call) for call in tool_calls]
        # Calls attached once a later delta was already rendered without them: the check cannot
        # take that delta as built from these inputs, so it renders it again (the full check).
        self._call_snapshots[turn] = snapshot(calls) if turn == len(self.messages) - 1 else None
        self._preview = None

    def _history_with_calls(self, end: int) -> list[dict]:
        """``messages[:end]`` with attached tool calls on their assistant turns."""
        return [dict(m, tool_calls=self._tool_calls[i]) if i in self._tool_calls else m
                for i, m in enumerate(self.messages[:end])]

    def append_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append non-assistant messages (tool results, user turns) with mask 0 and log-prob 0.0.

        The ids are the template's delta: the glue after the last generated token (``"\\n"``
        after ``<|im_end|>`` in ChatML; the whole turn suffix when generation stopped without
        EOS), the new messages and the next generation prompt. When messages were already
        appended since the last generation, that tail (including its generation prompt, which
        no engine has seen) is rendered again together with the new messages, so templates that
        group consecutive tool messages into one turn still match a full render.

        Args:
            messages: Messages with a role other than ``assistant``.

        Returns:
            The mask-0 ids that now follow the last generated token (with one call per turn:
            exactly the ids this call appended). Before any generation: the new prompt_ids.

        Raises:
            ValueError: for an assistant message or a message without a role.
            TokenizationMismatchError: when the template cannot be split into turns.
        """
        new = _check_new_messages(messages)
        # Drop the mask-0 tail after the last generated piece; it is rendered again below.
        while self._pieces and self._pieces[-1].kind == "appended":
            self._pieces.pop()
        if self._pieces[-1].kind == "prompt":
            self.messages.extend(new)
            self._snapshots.extend(snapshot(m) for m in new)
            text = self._render_prompt(self.messages)
            self.prompt_ids = self.renderer.encode(text)
            self._pieces = [_Piece("prompt", text, len(self.prompt_ids), digest=ids_digest(self.prompt_ids))]
            return list(self.prompt_ids)
        delta = self._delta_after_last_turn(new)
        keep = sum(p.n_ids for p in self._pieces) - len(self.prompt_ids)
        del self.response_ids[keep:], self.response_mask[keep:]
        self.response_ids.extend(delta.ids)
        self.response_mask.extend([0] * len(delta.ids))
        if self.response_logprobs is not None:
            del self.response_logprobs[keep:]
            self.response_logprobs.extend([0.0] * len(delta.ids))
        self.messages.extend(new)
        self._snapshots.extend(snapshot(m) for m in new)
        self._pieces.append(_Piece("appended", delta.text, len(delta.ids), digest=ids_digest(delta.ids)))
        return list(delta.ids)

    def preview_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The mask-0 ids that would follow the last generated token if ``messages`` were
        appended now, without appending them (for a budget check before :meth:`append_messages`,
        which then reuses the result). Before any generation: the prompt ids they would give.

        Raises:
            ValueError, TokenizationMismatchError: as :meth:`append_messages`.
        """
        new = _check_new_messages(messages)
        if not self._generated_messages:
            return self.renderer.render_prompt([*self.messages, *new])
        return list(self._delta_after_last_turn(new).ids)

    def _delta_after_last_turn(self, new: list[dict]) -> DeltaResult:
        """What follows the last generated turn once ``new`` joins the messages after it (with
        attached calls on their turns); the last preview is reused when it asked the same."""
        key = (len(self.messages), json.dumps(new, sort_keys=True, default=str))
        if self._preview is not None and self._preview[0] == key:
            return self._preview[1]
        last = self._generated_messages[-1]
        history, following = self._history_with_calls(last + 1), self.messages[last + 1 :] + new
        ended = self._last_ended_with_eos
        if self._history_deltas:
            text = self._render_once(
                ("delta", history, following, ended),
                lambda: self.renderer.delta_text(history, following, assistant_ended_with_eos=ended,
                                                 strategy="history"))
            delta = DeltaResult(self.renderer.encode(text), text)
        else:
            delta = self.renderer.delta(history, following, assistant_ended_with_eos=ended)
        self._preview = (key, delta)
        return delta

    # -- renders the check reuses ------------------------------------------------------------

    def _render_once(self, inputs: tuple, render: Callable[[], str]) -> str:
        """``render()``, or the text an earlier call with the same ``inputs`` got.

        A render reads the messages (attached calls included), the turn-ended flag, and the
        renderer's tools, template and template variables. The key is the template text and a
        128-bit BLAKE2 digest of the rest as JSON (dict order kept), taken afresh at every
        call, so a message or a setting changed since is a different key and renders again; a
        digest keeps the memory per trajectory linear in its length. Inputs that are not JSON
        (images) always render. Reusing a text assumes the template renders the same inputs
        to the same text, which is what the sanity check compares against anyway.
        """
        renderer = self.renderer
        digest = snapshot([inputs, renderer.tools, renderer.apply_chat_template_kwargs])
        if digest is None:  # not JSON (images, circular): nothing to compare by
            return render()
        template = renderer.chat_template or getattr(renderer.processor, "chat_template", None)
        key = (digest, template)
        try:
            text = self._rendered.get(key)
        except TypeError:  # a template that is not a string (a dict of named templates)
            return render()
        if text is None:
            text = self._rendered[key] = render()
        return text

    def _render_prompt(self, messages: list[dict]) -> str:
        """``messages`` rendered with the generation prompt (kept for the check)."""
        return self._render_once(("prompt", messages),
                                 lambda: self.renderer.render_text(messages, add_generation_prompt=True))

    # -- checking and output ---------------------------------------------------------------

    def _reference_text(self) -> tuple[str, str]:
        """Text the built ids should encode, and a note on which view it is."""
        if self.renderer.use_inference_chat_template:
            return self._inference_text(), "inference view: the template over the whole conversation"
        return self._engine_text(), "engine view: each generation's context as the template renders it"

    def _engine_text(self) -> str:
        """The training (engine) view, rebuilt from the messages, not from the ids the
        trajectory took: the prompt rendered with its generation prompt; each generated turn's
        text verbatim; after it, what the template renders for the messages that followed, cut
        from a render of the whole history up to them (``delta_strategy="history"``). Whatever
        the template does to generated turns once later messages exist (strip reasoning, add an
        empty think block to the last turn, swap ``<|return|>`` for ``<|end|>``, refuse channel
        tags in content) is not what the engine saw, so it is not compared.

        A render the trajectory already made with exactly these inputs is reused
        (:meth:`_render_once`): ids that do not follow from the messages (a delta rendered
        from other messages or after a short history that the template reads differently,
        ids lost or doubled, a message changed after it was rendered) still differ."""
        generated = self._generated_messages
        first = generated[0] if generated else len(self.messages)
        text = self._render_prompt(self.messages[:first])
        pieces = [p for p in self._pieces if p.kind == "generated"]
        for k, index in enumerate(generated):
            text += pieces[k].text
            following = self.messages[index + 1 : generated[k + 1] if k + 1 < len(generated) else len(self.messages)]
            if following:
                history, ended = self._history_with_calls(index + 1), pieces[k].ended
                text += self._render_once(
                    ("delta", history, following, ended),
                    lambda h=history, f=following, e=ended: self.renderer.delta_text(
                        h, f, assistant_ended_with_eos=e, strategy="history"))
        return text

    def _inference_text(self) -> str:
        """The inference view: the template over all messages, generated contents as decoded
        text, as an inference server renders a conversation it is sent."""
        pending = self._pieces[-1].kind != "generated"
        text = self.renderer.render_text(self.messages, add_generation_prompt=pending)
        if not pending:
            # The trajectory ends right after the generated ids; the template's glue after
            # them was never appended.
            glue = self.renderer.glue_after_assistant(self._last_ended_with_eos)
            if glue and text.endswith(glue):
                text = text[: -len(glue)]
        return text

    def _settings_snapshot(self) -> tuple:
        """What every render reads besides the messages."""
        r = self.renderer
        return (snapshot([r.tools, r.apply_chat_template_kwargs]), id(r.chat_template or getattr(r.processor, "chat_template", None)),
                r.use_inference_chat_template)

    def _unchanged_since_rendered(self, built: list[int]) -> bool:
        """Whether the engine view's reference is the built text by construction: every delta
        was rendered over the whole history, and no message, attached call, renderer setting
        or id changed since it was appended."""
        if not self._history_deltas or self.renderer.use_inference_chat_template:
            return False
        if self._settings_snapshot() != self._settings or None in self._settings:
            return False
        if len(self._snapshots) != len(self.messages) or any(
                was is None or was != snapshot(m) for was, m in zip(self._snapshots, self.messages, strict=True)):
            return False
        if any(self._call_snapshots.get(i) is None or self._call_snapshots[i] != snapshot(calls)
               for i, calls in self._tool_calls.items()):
            return False
        at = 0
        for p in self._pieces:
            if p.digest != ids_digest(built[at : at + p.n_ids]):
                return False
            at += p.n_ids
        return at == len(built)

    def _turn_by_turn_check(self, mode: SanityCheckMode) -> SanityCheckReport:
        """The engine-view check of an unchanged trajectory (see
        :mod:`agentloop_core.tokenization.incremental`): it passes by construction; only
        ``canonical`` is computed, turn by turn where the tokenizer allows it."""
        built, renderer = self.context_ids, self.renderer
        encode = turn_encoder(renderer.tokenizer)
        pieces, at = [], 0
        for p in self._pieces:  # the ids are the built ones: _unchanged_since_rendered said so
            pieces.append(_PieceIds(p.kind, p.text, built[at : at + p.n_ids]))
            at += p.n_ids
        canonical = None if encode is None else canonical_by_turn(
            pieces, encode, renderer._special_pattern, renderer.special_ids)
        if canonical is None:
            canonical = renderer.encode("".join(p.text for p in self._pieces)) == built
        if canonical:
            return SanityCheckReport(ok=True, mode=mode, canonical=True)
        return SanityCheckReport(ok=True, mode=mode, canonical=False, reason=(
            "generated ids are a non-canonical tokenization of their text; engine view: each generation's "
            "context as the template renders it"))

    def sanity_check(self, mode: SanityCheckMode = "strict") -> SanityCheckReport:
        """Compare the built ids with a re-tokenization of the rendered conversation.

        The reference is the template applied to :attr:`messages` (see
        ``use_inference_chat_template`` on :class:`ChatRenderer` for templates that rewrite
        history). Generated ids are compared verbatim against their place in the text: a
        non-canonical tokenization sampled by the engine is not a delta error, and is reported
        as ``canonical=False``. Everything else must match the re-tokenized reference.

        In the engine view, a trajectory whose deltas were rendered over the whole history
        (the default with a check) and of which nothing changed since is checked turn by turn
        instead: its reference is its own text by construction, so only whether its ids are
        the canonical encoding is computed, each generated turn encoded once with the text
        around it (:mod:`agentloop_core.tokenization.incremental`). Anything else (a changed
        message or setting, edited ids, short deltas, the inference view) takes the full
        re-encode below, with the same verdicts.

        Args:
            mode: ``strict`` (any difference fails), ``ignore_strippable`` (a difference in
                whitespace only passes), or ``disable``.

        Returns:
            The report; this method never raises on a mismatch.
        """
        check_mode(mode)
        if mode == "disable":
            return SanityCheckReport(ok=True, mode=mode, reason="sanity check disabled")
        if self._unchanged_since_rendered(self.context_ids):
            return self._turn_by_turn_check(mode)
        return self._full_check(mode)

    def _full_check(self, mode: SanityCheckMode) -> SanityCheckReport:
        """The check by one re-encode of the whole reference text (see :meth:`sanity_check`)."""
        built = self.context_ids
        try:
            ref_text, note = self._reference_text()
        except Exception as exc:
            if not raised_by_template(exc):
                raise
            return SanityCheckReport(ok=False, mode=mode, reason=(
                f"the chat template refuses the reference conversation ({note_for(self.renderer)}): "
                f"{template_refusal(exc) or exc}"))
        full = self.renderer.encode(ref_text)
        canonical = full == built
        if canonical:
            return SanityCheckReport(ok=True, mode=mode, canonical=True)
        expected = full
        own_text = "".join(p.text for p in self._pieces)
        if own_text == ref_text and sum(p.n_ids for p in self._pieces) == len(built):
            # Same text: keep generated ids verbatim and re-tokenize only the other pieces.
            expected, pos, at = [], 0, 0
            for p in self._pieces:
                if p.kind == "generated":
                    expected += built[at : at + p.n_ids]
                else:
                    expected += self.renderer.encode(ref_text[pos : pos + len(p.text)])
                pos += len(p.text)
                at += p.n_ids
            if expected == built:
                note = "generated ids are a non-canonical tokenization of their text; " + note
        return compare(self.renderer, built, expected, mode=mode, canonical=canonical, note=note)

    def to_output(
        self,
        *,
        reward_score: float | None = None,
        metrics: Mapping[str, Any] | None = None,
        extra_fields: Mapping[str, Any] | None = None,
        sanity_check: SanityCheckMode = "strict",
    ) -> AgentLoopOutput:
        """Run the sanity check and package the trajectory.

        A failing report is logged as a warning showing the mismatching text and recorded as
        ``metrics["tokenization_mismatch"] = 1``; in ``strict`` mode it also raises.
        ``metrics["tokenization_noncanonical"] = 1`` marks engine-sampled non-canonical
        tokenizations, which pass.

        Args:
            reward_score: Scalar reward, if known.
            metrics: Timings and counters to carry.
            extra_fields: Loop-specific data to carry.
            sanity_check: ``strict``, ``ignore_strippable`` or ``disable``.

        Returns:
            The :class:`AgentLoopOutput`; ``num_turns`` is the number of messages.

        Raises:
            TokenizationMismatchError: in strict mode when the check fails.
        """
        report = self.sanity_check(sanity_check)
        out_metrics = dict(metrics or {})
        if report.canonical is False:
            out_metrics["tokenization_noncanonical"] = 1
        if not report.ok:
            out_metrics["tokenization_mismatch"] = 1
            logger.warning("%s", report.describe())
            if sanity_check == "strict":
                raise TokenizationMismatchError(
                    report.describe() + "\nFix the delta (or the chat template), or pass "
                    "sanity_check='ignore_strippable' / 'disable' to accept it."
                )
        elif report.first_mismatch is not None:
            out_metrics["tokenization_mismatch_ignored"] = 1
        return AgentLoopOutput(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_mask=list(self.response_mask),
            response_logprobs=None if self.response_logprobs is None else list(self.response_logprobs),
            reward_score=reward_score,
            num_turns=len(self.messages),
            metrics=out_metrics,
            extra_fields=dict(extra_fields or {}),
        )


def note_for(renderer: ChatRenderer) -> str:
    """Which view a trajectory's sanity check compares with (see ``use_inference_chat_template``)."""
    return "inference view" if renderer.use_inference_chat_template else "engine view"


def _check_new_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    new = [_check_message(m, i) for i, m in enumerate(messages)]
    if not new:
        raise ValueError("append_messages needs at least one message")
    for m in new:
        if m["role"] == "assistant":
            raise ValueError(
                "append_messages got an assistant message; engine output goes through "
                "append_generated (mask 1) so its tokens are never re-encoded"
            )
    return new


def _check_message(message: Mapping[str, Any], index: int) -> dict:
    if not isinstance(message, Mapping):
        raise ValueError(f"message {index} is a {type(message).__name__}, expected a dict with 'role'")
    if not message.get("role"):
        raise ValueError(f"message {index} has no 'role': {dict(message)!r}")
    return dict(message)
