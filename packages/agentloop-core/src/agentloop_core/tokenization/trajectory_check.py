"""What a :class:`~agentloop_core.tokenization.trajectory.Trajectory` remembers of how it was
built (its pieces, digests of its ids and messages, the renders it made), and the sanity check
that compares its ids with the conversation they stand for."""

from __future__ import annotations

import hashlib
import weakref
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from agentloop_core.shared_ints import ReadOnlyIds, shared_ids
from agentloop_core.tokenization.content_marks import MARK
from agentloop_core.tokenization.incremental import Digests, canonical_by_turn, snapshot, turn_encoder
from agentloop_core.tokenization.renderer import ChatRenderer
from agentloop_core.tokenization.sanity import SanityCheckMode, SanityCheckReport, check_mode, compare
from agentloop_core.tokenization.template_errors import raised_by_template, template_refusal

PieceKind = Literal["prompt", "generated", "appended"]

SHARED_PROMPT_RENDERS = 4096
"""Prompt renders remembered per renderer across trajectories; the memory starts afresh when
it is full."""

_PROMPT_TEXTS: weakref.WeakKeyDictionary[ChatRenderer, dict[tuple[bytes, Any], str]] = weakref.WeakKeyDictionary()
"""Per renderer (held weakly): prompt texts by :meth:`TrajectoryCheck._render_once`'s key."""

_PROMPT_IDS: weakref.WeakKeyDictionary[ChatRenderer, dict[str, ReadOnlyIds]] = weakref.WeakKeyDictionary()
"""Per renderer (held weakly): the ids of a prompt text, by the text (see
:meth:`TrajectoryCheck._encode_prompt`)."""


@dataclass(slots=True)  # several per trajectory, thousands of trajectories in flight
class Piece:
    """One stretch of a trajectory's ids: what it stands for, and a digest of the ids as appended."""

    kind: PieceKind
    """prompt: the first render; generated: one generate call's ids; appended: glue + new
    messages + generation prompt."""
    body: str
    """The text these ids stand for, less :attr:`suffix` (see :attr:`text`)."""
    n_ids: int
    """How many ids of prompt_ids + response_ids this piece covers."""
    ended: bool = True
    """Generated pieces: whether the engine ended the turn on a stop token."""
    digest: bytes | tuple[int, ...] = ()
    """A digest of the ids this piece appended, as appended (:func:`ids_digest`): the check
    compares the trajectory's ids with it. A digest, not a copy, so a trajectory in flight
    holds its ids once."""
    suffix: str = ""
    """Generated pieces that ended on a stop token: its text (one interned string), which the
    assistant message's content leaves out; the body is then that content, the same string,
    so a turn's text is held once, not twice."""

    @property
    def text(self) -> str:
        """The text these ids stand for (decoded text for generated pieces)."""
        return self.body + self.suffix if self.suffix else self.body


class PieceIds(NamedTuple):
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


def note_for(renderer: ChatRenderer) -> str:
    """Which view a trajectory's sanity check compares with (see ``use_inference_chat_template``)."""
    return "inference view" if renderer.use_inference_chat_template else "engine view"


class TrajectoryCheck:
    """The renders a trajectory reuses and its sanity check; :class:`~agentloop_core.tokenization.trajectory.Trajectory`
    builds the state read here (its pieces, message and setting snapshots, attached calls)."""

    renderer: ChatRenderer
    messages: list[dict]
    _rendered: dict[tuple[bytes, Any], str]
    _history_deltas: bool
    _pieces: list[Piece]
    _snapshots: Digests
    _call_snapshots: dict[int, bytes | None]
    _settings: tuple
    _generated_messages: list[int]
    _tool_calls: dict[int, list[dict]]
    _last_ended_with_eos: bool

    @property
    def context_ids(self) -> list[int]:  # pragma: no cover - Trajectory's
        raise NotImplementedError

    def _history_with_calls(self, end: int) -> list[dict]:  # pragma: no cover - Trajectory's
        raise NotImplementedError

    def _expand(self, text: str, messages: Sequence[dict], where: str) -> str:  # pragma: no cover - Trajectory's
        raise NotImplementedError

    # -- renders the check reuses ------------------------------------------------------------

    def _render_once(self, inputs: tuple, render: Callable[[], str], *, shared: bool = False) -> str:
        """``render()``, or the text an earlier call with the same ``inputs`` got.

        A render reads the messages (attached calls included), the turn-ended flag, and the
        renderer's tools, template and template variables. The key is the template text and a
        128-bit BLAKE2 digest of the rest as JSON (dict order kept), taken afresh at every
        call, so a message or a setting changed since is a different key and renders again (the
        tools only where a change of ``renderer.tools`` reaches the render, see
        :func:`_live_tools`: dumping the schemas at every render was ~5% of a trajectory); a
        digest keeps the memory per trajectory linear in its length. Inputs that are not JSON
        (images) always render. Reusing a text assumes the template renders the same inputs
        to the same text, which is what the sanity check compares against anyway.

        ``shared``: the text may also come from, and goes to, a memory of the renderer's
        shared by every trajectory (:func:`_shared_texts`): GRPO rolls out each prompt several
        times, and rendering the same prompt again was the largest Jinja cost left per
        trajectory (issue 49). Its key is this same digest of everything the render reads.
        """
        renderer = self.renderer
        digest = snapshot([inputs, _live_tools(renderer), renderer.apply_chat_template_kwargs])
        if digest is None:  # not JSON (images, circular): nothing to compare by
            return render()
        template = _template(renderer)
        key = (digest, template)
        try:
            text = self._rendered.get(key)
        except TypeError:  # a template that is not a string (a dict of named templates)
            return render()
        if text is None:
            memory = _memory(_PROMPT_TEXTS, renderer) if shared and _shares_prompts(renderer, template) else None
            text = None if memory is None else memory.get(key)
            if text is None:
                text = render()
                if memory is not None:
                    _remember(_PROMPT_TEXTS, renderer, memory, key, text)
            self._rendered[key] = text
        return text

    def _encode_prompt(self, text: str) -> list[int]:
        """The ids of the prompt text ``text`` (``shared_ids(renderer.encode(text))``), as one
        list shared by every trajectory whose prompt renders to the same text where the
        renderer shares prompt renders (:func:`_shares_prompts`): a GRPO group's n samples hold
        their prompt's ids once, not n times, and encode them once. The list is never changed
        in place (a trajectory replaces its ``prompt_ids``). The
        memory holds :data:`SHARED_PROMPT_RENDERS` prompts, then starts afresh. The list is a
        :class:`~agentloop_core.shared_ints.ReadOnlyIds`, so the outputs share it too."""
        renderer = self.renderer
        if not _shares_prompts(renderer, _template(renderer)):
            return ReadOnlyIds(shared_ids(renderer.encode(text)))
        memory = _memory(_PROMPT_IDS, renderer)
        ids = memory.get(text)
        if ids is None:
            ids = ReadOnlyIds(shared_ids(renderer.encode(text)))
            _remember(_PROMPT_IDS, renderer, memory, text, ids)
        return ids

    def _render_prompt(self, messages: list[dict]) -> str:
        """``messages`` rendered with the generation prompt (kept for the check)."""
        return self._render_once(("prompt", messages), lambda: self._expand(
            self.renderer.render_text(messages, add_generation_prompt=True), messages, "prompt"), shared=True)

    # -- the sanity check ----------------------------------------------------------------------


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
                    lambda h=history, f=following, e=ended: self._expand(self.renderer.delta_text(
                        h, f, assistant_ended_with_eos=e, strategy="history"), f, "delta"))
        return text

    def _inference_text(self) -> str:
        """The inference view: the template over all messages, generated contents as decoded
        text, as an inference server renders a conversation it is sent."""
        pending = self._pieces[-1].kind != "generated"
        text = self._expand(self.renderer.render_text(self.messages, add_generation_prompt=pending,
                                                      generated=self._generated_messages),
                            self.messages, "the whole conversation")
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
        return (snapshot([_live_tools(r), r.apply_chat_template_kwargs]), id(_template(r)),
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
        by_turn = turn_encoder(renderer.tokenizer)
        encode = None if by_turn is None else _reading_marks(by_turn, renderer)
        pieces, at = [], 0
        for p in self._pieces:  # the ids are the built ones: _unchanged_since_rendered said so
            pieces.append(PieceIds(p.kind, p.text, built[at : at + p.n_ids]))
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


def _reading_marks(encode: Callable[[list[str]], list[list[int]]],
                   renderer: ChatRenderer) -> Callable[[list[str]], list[list[int]]]:
    """``encode``, except that texts holding a content mark (a generated turn next to marked
    content, in a template that writes no special token between them) go to the renderer,
    which encodes marks as text."""
    def both(texts: list[str]) -> list[list[int]]:
        return [renderer.encode(t) for t in texts] if any(MARK in t for t in texts) else encode(texts)
    return both


def _template(renderer: ChatRenderer) -> Any:
    """The template ``renderer``'s renders read: its own, else its processor's."""
    return renderer.chat_template or getattr(renderer.processor, "chat_template", None)


def _shares_prompts(renderer: ChatRenderer, template: Any) -> bool:
    """Whether ``renderer`` shares prompt renders (and their ids) across trajectories: not
    where a render is not a function of the key alone: a vision renderer (an image's expansion
    depends on the trajectory's image limits, not only on its digest in the message), a
    template that reads the clock (``strftime_now``: Llama's "Today Date"), or one that is not
    a string."""
    return renderer.vision is None and isinstance(template, str) and "strftime_now" not in template


def _memory(tables: weakref.WeakKeyDictionary[ChatRenderer, dict[Any, Any]], renderer: ChatRenderer) -> dict[Any, Any]:
    """``renderer``'s memory in ``tables`` (:data:`_PROMPT_TEXTS`, :data:`_PROMPT_IDS`), made on first use."""
    memory = tables.get(renderer)
    if memory is None:
        memory = tables[renderer] = {}
    return memory


def _remember(tables: weakref.WeakKeyDictionary[ChatRenderer, dict[Any, Any]], renderer: ChatRenderer,
              memory: dict[Any, Any], key: Any, value: Any) -> None:
    """Put ``key: value`` in ``memory`` (``renderer``'s in ``tables``); a memory that holds
    :data:`SHARED_PROMPT_RENDERS` entries is replaced by a fresh one first."""
    if len(memory) >= SHARED_PROMPT_RENDERS:
        memory = tables[renderer] = {}
    memory[key] = value


def _live_tools(renderer: ChatRenderer) -> list[dict] | None:
    """``renderer.tools`` where the renders read them as they are now (with
    ``allow_special_tokens_in_content``); None where the renderer renders the marked copy it
    made at construction, which a later change of ``renderer.tools`` does not reach."""
    tools = renderer.tools
    return tools if getattr(renderer, "_render_tools", None) is tools else None
