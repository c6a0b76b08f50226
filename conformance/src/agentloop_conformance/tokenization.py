"""Tokenization conformance tests: subclass :class:`TokenizationConformanceTests` and define one
fixture, ``tokenizer`` (a Hugging Face tokenizer with a chat template).

Each test replays multi-turn conversations (system, user, tool calls and results, several
rounds, unicode, empty content, reasoning) the way an agent loop builds a trajectory: the
assistant turns come in as "generated" ids (the tokenization of the text the template renders
for them), everything else is appended as a template delta with mask 0.

A conversation the chat template refuses as written (``raise_exception(...)``: Llama 3.1 on
parallel tool calls, Mistral on tool call ids that are not 9 characters) skips with the
template's message; any other error (a template crash, a refusal of messages the replay built, a
bug in the code under test) fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from agentloop_conformance._guard import SuiteGuard
from agentloop_conformance.conversations import CONVERSATIONS, Conversation
from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import TemplateTurnError, one_render_holds, template_turn_text
from agentloop_core.tokenization import ChatRenderer, Trajectory
from agentloop_core.tokenization.sanity import compare
from agentloop_core.tokenization.template_errors import template_refusal


class ConformanceNote(UserWarning):
    """A difference the suite accepted (e.g. whitespace under ``ignore_strippable``), named."""


@dataclass
class GeneratedBlock:
    """One replayed assistant turn."""

    start: int
    """Index in prompt_ids + response_ids of its first id."""
    ids: list[int]
    """The ids fed as engine output."""
    log_probs: list[float]
    """The log-probs fed with them."""
    text: str
    """The text those ids encode (assistant content plus the end-of-turn token)."""


@dataclass
class Replay:
    """A conversation replayed into a :class:`Trajectory`."""

    conversation: Conversation
    renderer: ChatRenderer
    trajectory: Trajectory
    blocks: list[GeneratedBlock]


def generated_text(renderer: ChatRenderer, history: list[dict], message: dict) -> str:
    """The text a model writes for ``message`` after ``history``: what the template renders
    for the turn after the generation prompt, up to and including its closing token (see
    :func:`agentloop_core.testing.template_turn_text`)."""
    try:
        return template_turn_text(renderer, history, message)
    except TemplateTurnError as exc:
        pytest.fail(str(exc))


@contextmanager
def skip_when_the_template_refuses() -> Iterator[None]:
    """Skip the test when the chat template raises its own ``raise_exception(...)``, naming its
    message; every other exception propagates (the check does not apply, it never passes)."""
    try:
        yield
    except Exception as exc:
        refusal = template_refusal(exc)
        if refusal is None:
            raise
        pytest.skip(f"the chat template refuses this conversation: {refusal}")


def render_as_written(tokenizer: Any, conversation: Conversation, *, chat_template: str | None = None,
                      apply_chat_template_kwargs: dict | None = None) -> tuple[ChatRenderer, str]:
    """A renderer for ``conversation`` and its text as written; skips the test when the template
    refuses it. Only the conversation as written may skip; a replay never hands the engine's
    decoded text to the template (generated turns are rendered opaque), so gpt-oss refusing
    ``<|channel|>`` tags in content cannot be triggered by it."""
    with skip_when_the_template_refuses():
        renderer = ChatRenderer(tokenizer, tools=conversation.tools, chat_template=chat_template,
                                apply_chat_template_kwargs=apply_chat_template_kwargs)
        return renderer, renderer.render_text(conversation.messages, add_generation_prompt=False)


def replay(tokenizer: Any, conversation: Conversation, *, chat_template: str | None = None,
           apply_chat_template_kwargs: dict | None = None) -> Replay:
    """Build the trajectory of ``conversation`` as an agent loop would."""
    renderer = ChatRenderer(tokenizer, tools=conversation.tools, chat_template=chat_template,
                            apply_chat_template_kwargs=apply_chat_template_kwargs)
    messages = conversation.messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    trajectory = Trajectory(renderer, messages[:first])
    blocks: list[GeneratedBlock] = []
    i = first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            text = generated_text(renderer, messages[:i], messages[i])
            ids = renderer.encode(text)
            log_probs = [-0.001 * (1 + len(blocks)) - 0.0001 * j for j in range(len(ids))]
            start = len(trajectory.context_ids)
            trajectory.append_generated(TokenOutput(token_ids=ids, log_probs=log_probs))
            if messages[i].get("tool_calls"):
                trajectory.attach_tool_calls(messages[i]["tool_calls"])
            blocks.append(GeneratedBlock(start, ids, log_probs, text))
            i += 1
        else:
            j = i
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            trajectory.append_messages(messages[i:j])
            i = j
    return Replay(conversation, renderer, trajectory, blocks)


def expected_text(replayed: Replay) -> str | None:
    """The template's text for the whole replayed conversation (ending right after the last
    generated id when it ends with an assistant turn); None when no single render holds every
    turn as the engine saw and wrote it (the template rewrites earlier turns: Qwen3, gpt-oss,
    Mistral), so the trajectory is checked turn by turn (the engine view) only."""
    renderer, messages = replayed.renderer, replayed.conversation.messages
    if not one_render_holds(renderer, messages):
        return None
    ends_generated = messages[-1]["role"] == "assistant"
    text = renderer.render_text(messages, add_generation_prompt=not ends_generated)
    if ends_generated:
        # Up to the last turn's closing token: the glue after it was never appended.
        last = next(i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant")
        seen = renderer.render_text(messages[:last], add_generation_prompt=True)
        text = text[: len(seen) + len(template_turn_text(renderer, messages[:last], messages[last]))]
    return text


class TokenizationConformanceTests(SuiteGuard):
    """Delta tokenization against full tokenization, decoding, round trips and masks. A
    conversation the chat template refuses as written (``raise_exception``) skips with its
    message; see :func:`render_as_written`."""

    __conformance_suite__ = True

    allowed_sanity_mode: ClassVar[str] = "strict"
    """``strict``: delta ids must equal the full tokenization. ``ignore_strippable``: a
    whitespace-only difference passes, and is named in a :class:`ConformanceNote` warning."""

    @pytest.fixture
    def tokenizer(self) -> Any:
        """The tokenizer under test. Required: override it to return a Hugging Face tokenizer
        (or processor) with a chat template."""
        pytest.fail(f"{type(self).__name__} must define a `tokenizer` fixture (see the agentloop-conformance README)")

    @pytest.fixture
    def chat_template(self) -> str | None:
        """A Jinja chat template replacing the tokenizer's own; None keeps it."""
        return None

    @pytest.fixture
    def apply_chat_template_kwargs(self) -> dict[str, Any]:
        """Extra template variables (e.g. ``{"enable_thinking": False}``)."""
        return {}

    @pytest.fixture(params=CONVERSATIONS, ids=[c.name for c in CONVERSATIONS])
    def conversation(self, request: Any) -> Conversation:
        """The conversations replayed; override to add your own."""
        return request.param

    @pytest.fixture
    def replayed(self, tokenizer: Any, conversation: Conversation, chat_template: str | None,
                 apply_chat_template_kwargs: dict[str, Any]) -> Replay:
        render_as_written(tokenizer, conversation, chat_template=chat_template,
                          apply_chat_template_kwargs=apply_chat_template_kwargs)
        return replay(tokenizer, conversation, chat_template=chat_template,
                      apply_chat_template_kwargs=apply_chat_template_kwargs)

    def test_delta_equals_full_tokenization(self, replayed: Replay) -> None:
        """The trajectory's ids (prompt, generated turns, template deltas) equal a tokenization
        of the whole conversation rendered at once. Debug: the failure shows the text around
        the first differing token; a newline or space merged differently at a turn boundary
        means the tokenizer does not split at the template's special tokens."""
        traj = replayed.trajectory
        report = traj.sanity_check("strict")
        expected = expected_text(replayed)
        if report.ok and expected is not None:
            # The replayed turns are canonical tokenizations of their text, so the whole
            # sequence must also equal one tokenization of the whole text; the core check
            # alone re-tokenizes piece by piece and would accept a tokenizer whose encode
            # behaves differently across turn boundaries.
            full = replayed.renderer.encode(expected)
            report = compare(replayed.renderer, traj.context_ids, full, mode="strict", canonical=full == traj.context_ids,
                             note="compared with one tokenization of the whole rendered conversation")
        if report.ok:
            return
        if self.allowed_sanity_mode == "ignore_strippable":
            relaxed = traj.sanity_check("ignore_strippable")
            if relaxed.ok:
                warnings.warn(ConformanceNote(
                    f"{replayed.conversation.name}: accepted under ignore_strippable: {relaxed.describe()}"), stacklevel=1)
                return
        pytest.fail(report.describe())

    def test_decoded_ids_render_the_template_text(self, replayed: Replay) -> None:
        """Decoding the prompt ids gives exactly the template's text for the prompt messages,
        and decoding the whole trajectory gives the template's text for the whole conversation.
        Debug: a tokenizer that normalises or drops characters (spaces, newlines after special
        tokens, unicode) fails here; compare the two texts in the message."""
        traj, renderer = replayed.trajectory, replayed.renderer
        messages = replayed.conversation.messages
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        expected_prompt = renderer.render_text(messages[:first], add_generation_prompt=True)
        assert renderer.decode(traj.prompt_ids) == expected_prompt, (
            f"decoded prompt differs from the template text:\n  decoded:  {renderer.decode(traj.prompt_ids)!r}\n"
            f"  template: {expected_prompt!r}")
        expected = expected_text(replayed)
        if expected is None:
            return  # the template rewrites history: no single render holds the generated turns
        decoded = renderer.decode(traj.context_ids)
        assert decoded == expected, (
            f"decoded trajectory differs from the template text:\n  decoded:  {decoded!r}\n  template: {expected!r}")

    def test_text_round_trip_is_lossless(self, tokenizer: Any, conversation: Conversation,
                                         chat_template: str | None, apply_chat_template_kwargs: dict[str, Any]) -> None:
        """decode(encode(text)) returns the rendered conversation unchanged. Debug: a lossy
        normaliser (NFKC, lower-casing, stripping) or an unknown-token fallback."""
        renderer, text = render_as_written(tokenizer, conversation, chat_template=chat_template,
                                           apply_chat_template_kwargs=apply_chat_template_kwargs)
        back = renderer.decode(renderer.encode(text))
        assert back == text, f"round trip changed the text:\n  before: {text!r}\n  after:  {back!r}"

    def test_generated_ids_kept_verbatim(self, replayed: Replay) -> None:
        """Each generated turn's ids stay exactly where they were appended after later turns
        are added, and decode to the text the model wrote. Debug: a delta that re-tokenizes
        across the end of a generated turn changes its last ids."""
        ids = replayed.trajectory.context_ids
        for k, block in enumerate(replayed.blocks):
            assert ids[block.start : block.start + len(block.ids)] == block.ids, f"generated turn {k} was altered"
            assert replayed.renderer.decode(block.ids) == block.text, f"generated turn {k} does not decode to its text"

    def test_masks_align(self, replayed: Replay) -> None:
        """response_mask is 1 exactly on the generated ids, response_logprobs carries their
        log-probs there and 0.0 elsewhere, and all three have one entry per response id."""
        traj = replayed.trajectory
        out = traj.to_output(sanity_check="disable")
        n_prompt = len(out.prompt_ids)
        expected_mask = [0] * len(out.response_ids)
        expected_lp = [0.0] * len(out.response_ids)
        for block in replayed.blocks:
            for j, lp in enumerate(block.log_probs):
                expected_mask[block.start - n_prompt + j] = 1
                expected_lp[block.start - n_prompt + j] = lp
        assert out.response_mask == expected_mask, "response_mask is not 1 exactly on the generated ids"
        assert out.response_logprobs == pytest.approx(expected_lp), "log-probs are not aligned with the mask"
