"""One trajectory as token ids: generated tokens verbatim (mask 1), everything else rendered by
the chat template as a delta (mask 0)."""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import TokenOutput
from agentloop_core.shared_ints import ReadOnlyIds, shared_ids
from agentloop_core.tokenization.incremental import Digests, snapshot
from agentloop_core.tokenization.renderer import ChatRenderer, DeltaResult, TokenizationMismatchError
from agentloop_core.tokenization.sanity import SanityCheckMode, check_mode
from agentloop_core.tokenization.trajectory_check import Piece, TrajectoryCheck, ids_digest
from agentloop_core.vision.content import ConversationImages, has_images
from agentloop_core.vision.images import ImageLimits
from agentloop_core.vision.processor import ImageItem

logger = logging.getLogger(__name__)


class Trajectory(TrajectoryCheck):
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
        image_limits: Pixel, byte and per-trajectory limits on images (prompt and appended
            messages together); None: the defaults.

    Images: an image part of a prompt or appended message (any form
    :mod:`agentloop_core.vision.content` reads) is decoded and processed once, when it enters,
    and kept in :attr:`messages` as ``{"type": "image", "image": digest}``; the renderer's
    :class:`~agentloop_core.vision.VisionProcessor` expands its placeholder to the image's
    tokens (mask 0), and :attr:`image_items` lists the images in order. The delta method and
    the sanity check treat those tokens as any other rendered ids.
    """

    def __init__(self, renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], *,
                 sanity_check: SanityCheckMode | None = None, image_limits: ImageLimits | None = None) -> None:
        if not messages:
            raise ValueError("a trajectory needs at least one prompt message")
        if sanity_check is not None:
            check_mode(sanity_check)
        self.renderer = renderer
        self.images = ConversationImages(renderer.vision, image_limits)
        """The images of this conversation, each decoded and processed once."""
        self.messages: list[dict] = self._take_images([_check_message(m, i) for i, m in enumerate(messages)], "prompt message")
        """Text history; assistant content is the decoded generated text, verbatim."""
        self._rendered: dict[tuple[bytes, Any], str] = {}
        """Texts of the prompt and history-delta renders made so far, by a digest of everything
        the render read (see :meth:`_render_once`)."""
        self._history_deltas = renderer.delta_strategy == "history" or (
            renderer.delta_strategy == "auto" and sanity_check in ("strict", "ignore_strippable")
            and not renderer.use_inference_chat_template)
        """Whether deltas are rendered over the whole history (and kept for the check)."""
        text = self._render_prompt(self.messages)
        self.prompt_ids: list[int] = self._encode_prompt(text)
        """The rendered prompt with generation prompt: the first generate input. The same list
        as other trajectories' of the same prompt text (see :meth:`_encode_prompt`): replace
        it, never change it in place."""
        self.response_ids: list[int] = []
        """Generated ids (mask 1) interleaved with rendered glue/tool/user ids (mask 0)."""
        self.response_mask = bytearray()
        """1 for engine-generated ids, 0 for all other ids: one byte per id while the
        trajectory is built (a list costs 8); :meth:`to_output` gives the output a list."""
        self.response_logprobs: array[float] | None = None
        """Engine log-prob per response id (0.0 on mask 0), as doubles: the engine's values
        exactly, 8 bytes per id where a list of floats costs 32; None until an engine returns
        some. :meth:`to_output` gives the output a list."""
        self.num_generations = 0
        """How many generate outputs were appended."""
        self._pieces: list[Piece] = [Piece("prompt", text, len(self.prompt_ids), digest=ids_digest(self.prompt_ids))]
        self._snapshots = Digests(snapshot(m) for m in self.messages)
        """A digest of each message as JSON when it was appended: the check's proof that it is unchanged."""
        self._call_snapshots: dict[int, bytes | None] = {}
        self._settings = self._settings_snapshot()
        self._generated_messages: list[int] = []
        self._tool_calls: dict[int, list[dict]] = {}
        self._preview: tuple[tuple | None, DeltaResult] | None = None
        self._last_ended_with_eos = True

    @property
    def context_ids(self) -> list[int]:
        """prompt_ids + response_ids: the next ``generate`` input."""
        return self.prompt_ids + self.response_ids

    @property
    def image_items(self) -> list[ImageItem]:
        """The images of the conversation in the order their tokens appear (the prompt's, then
        each appended message's): what ``generate`` needs beside :attr:`context_ids`."""
        return self.images.in_messages(self.messages) if self.images.items else []

    def _take_images(self, messages: list[dict], where: str, *, count: bool = True) -> list[dict]:
        if not has_images(messages):
            return messages
        return self.images.take(messages, where=where, count=count)

    def _expand(self, text: str, messages: Sequence[Mapping[str, Any]], where: str) -> str:
        """A render of ``messages`` with its image placeholders expanded to their images' tokens."""
        if self.renderer.vision is None:
            return text
        return self.renderer.expand_images(text, self.images.in_messages(messages), where=where)

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
        # Shared int objects: a trajectory holds its ids until the batch returns (shared_ints).
        ids = shared_ids(out.token_ids)
        if out.log_probs is not None:
            if self.response_logprobs is None:
                if any(self.response_mask):
                    raise ValueError(
                        "the engine returned log-probs for this turn but not for earlier ones; "
                        "request logprobs on every generate call of a trajectory"
                    )
                self.response_logprobs = array("d", bytes(8 * len(self.response_ids)))
            self.response_logprobs.extend(out.log_probs)
        elif self.response_logprobs is not None and ids:
            raise ValueError(
                "the engine returned no log-probs for this turn but did for earlier ones; "
                "request logprobs on every generate call of a trajectory"
            )
        self.response_ids.extend(ids)
        self.response_mask.extend(b"\x01" * len(ids))
        text = self.renderer.decode(ids)
        ended = self.renderer.ended_turn(ids, out.stop_reason)
        stop_text = self.renderer.decode(ids[-1:]) if ended else ""
        content, suffix = text, ""
        if stop_text and text.endswith(stop_text):
            # The piece keeps the content and the stop token's text, not a second copy of the turn.
            content, suffix = text[: -len(stop_text)], sys.intern(stop_text)
        message = {"role": "assistant", "content": content}
        self.messages.append(message)
        self._snapshots.append(snapshot(message))
        self._generated_messages.append(len(self.messages) - 1)
        self._pieces.append(Piece("generated", content, len(ids), ended, ids_digest(ids), suffix))
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
        new = self._take_images(_check_new_messages(messages), "appended message")
        snaps = [snapshot(m) for m in new]
        # Drop the mask-0 tail after the last generated piece; it is rendered again below.
        while self._pieces and self._pieces[-1].kind == "appended":
            self._pieces.pop()
        if self._pieces[-1].kind == "prompt":
            self.messages.extend(new)
            self._snapshots.extend(snaps)
            text = self._render_prompt(self.messages)
            self.prompt_ids = self._encode_prompt(text)
            self._pieces = [Piece("prompt", text, len(self.prompt_ids), digest=ids_digest(self.prompt_ids))]
            return list(self.prompt_ids)
        delta = self._delta_after_last_turn(new, snaps)
        keep = sum(p.n_ids for p in self._pieces) - len(self.prompt_ids)
        del self.response_ids[keep:], self.response_mask[keep:]
        self.response_ids.extend(shared_ids(delta.ids))
        self.response_mask.extend(bytes(len(delta.ids)))
        if self.response_logprobs is not None:
            del self.response_logprobs[keep:]
            self.response_logprobs.extend(array("d", bytes(8 * len(delta.ids))))
        self.messages.extend(new)
        self._snapshots.extend(snaps)
        self._pieces.append(Piece("appended", delta.text, len(delta.ids), digest=ids_digest(delta.ids)))
        # The preview this delta may have come from asked about fewer messages than there now
        # are, so no later call can take it: drop it, not hold a second list of its ids while
        # the next turn waits for the engine.
        self._preview = None
        return list(delta.ids)

    def preview_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The mask-0 ids that would follow the last generated token if ``messages`` were
        appended now, without appending them (for a budget check before :meth:`append_messages`,
        which then reuses the result). Before any generation: the prompt ids they would give.

        Raises:
            ValueError, TokenizationMismatchError: as :meth:`append_messages`.
        """
        new = self._take_images(_check_new_messages(messages), "appended message", count=False)
        if not self._generated_messages:
            every = [*self.messages, *new]
            return self.renderer.render_prompt(every, self.images.in_messages(every) if self.images.items else ())
        return list(self._delta_after_last_turn(new, [snapshot(m) for m in new]).ids)

    def _delta_after_last_turn(self, new: list[dict], snaps: list[bytes | None]) -> DeltaResult:
        """What follows the last generated turn once ``new`` joins the messages after it (with
        attached calls on their turns); the last preview is reused when it asked the same.

        ``snaps``: the digests of ``new`` (:func:`snapshot`), which the caller takes anyway
        (``append_messages`` keeps them for the check); the preview is keyed by them, so
        a preview followed by its append dumps each new message once, not three times. A
        message that is not JSON (None) is never taken as the same."""
        key = None if None in snaps else (len(self.messages), tuple(snaps))
        if key is not None and self._preview is not None and self._preview[0] == key:
            return self._preview[1]
        last = self._generated_messages[-1]
        history, following = self._history_with_calls(last + 1), self.messages[last + 1 :] + new
        ended = self._last_ended_with_eos
        if self._history_deltas:
            text = self._render_once(
                ("delta", history, following, ended),
                lambda: self._expand(self.renderer.delta_text(history, following, assistant_ended_with_eos=ended,
                                                              strategy="history", framed=True), following, "delta"))
            delta = DeltaResult(self.renderer.encode(text), text)
        else:
            items = self.images.in_messages(following) if self.images.items else ()
            delta = self.renderer.delta(history, following, assistant_ended_with_eos=ended, images=items)
        self._preview = (key, delta)
        return delta

    # -- output ------------------------------------------------------------------------------

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
        items = self.image_items
        return AgentLoopOutput(
            # Read-only prompt ids are shared with the other samples of the prompt, not copied.
            prompt_ids=self.prompt_ids if type(self.prompt_ids) is ReadOnlyIds else list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_mask=list(self.response_mask),
            response_logprobs=None if self.response_logprobs is None else logprob_list(self.response_logprobs,
                                                                                        self.response_mask),
            multi_modal_data={"image": items} if items else None,
            reward_score=reward_score,
            num_turns=len(self.messages),
            metrics=out_metrics,
            extra_fields=dict(extra_fields or {}),
        )


_ZERO = 0.0
"""The one float object every mask-0 log-prob of an output refers to."""


def logprob_list(values: array[float], mask: bytearray) -> list[float]:
    """``values.tolist()`` with each run of mask-0 entries (tool, user and template tokens,
    whose log-prob the trajectory keeps at 0.0) referring to one shared ``0.0`` instead of a
    24-byte float object per token; the values are unchanged."""
    out = values.tolist()
    i = mask.find(0)
    while i != -1:
        j = mask.find(1, i)
        if j == -1:
            j = len(mask)
        out[i:j] = [_ZERO] * (j - i)
        i = mask.find(0, j)
    return out


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
