"""Delta multi-turn tokenization equals full re-tokenization, on the tiny tokenizer, on the tiny
tokenizer with each real chat template in ../shared/data/chat_templates (when present) and each
built-in tool-aware template, and on
every tokenizer folder listed in AGENTLOOP_TOKENIZER_DIRS (colon-separated)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import (
    COUNTING_TOOL_RESULTS_TEMPLATE,
    TemplateTurnError,
    load_tiny_tokenizer,
    one_render_holds,
    template_turn_text,
    tiny_tokenizer_for_template,
)
from agentloop_core.tokenization import (
    ChatRenderer,
    TokenizationMismatchError,
    Trajectory,
    chat_template_names,
    resolve_chat_template,
)
from agentloop_core.tokenization.builtin_templates import BUILTINS
from agentloop_core.tokenization.template_errors import template_refusal

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "description": "the expression"}},
                "required": ["x"],
            },
        },
    }
]


# AGENTLOOP_CHAT_TEMPLATES points at the folder from a checkout that is not beside ../shared.
SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")


def _tokenizer_params() -> list:
    params = [pytest.param("tiny", id="tiny")]
    # The real templates with the tiny tokenizer (plus the harmony and Mistral special tokens).
    params += [pytest.param(f"template:{path}", id=path.stem) for path in sorted(SHARED_TEMPLATES.glob("*.jinja"))]
    # The built-in tool-aware templates with the tiny tokenizer (plus Llama 3's tokens).
    params += [pytest.param(f"builtin:{name}", id=f"builtin-{name}") for name in chat_template_names()]
    for folder in filter(None, os.environ.get("AGENTLOOP_TOKENIZER_DIRS", "").split(":")):
        params.append(pytest.param(folder, id=Path(folder).name or folder))
        # The folder's tokenizer with each built-in (a checkpoint whose own template ignores tools).
        params += [pytest.param(f"builtin:{name}@{folder}", id=f"{Path(folder).name or folder}-{name}")
                   for name in chat_template_names()]
    return params


@pytest.fixture(scope="module", params=_tokenizer_params())
def tok(request):
    if request.param == "tiny":
        return load_tiny_tokenizer()
    if request.param.startswith("template:"):
        return tiny_tokenizer_for_template(request.param.removeprefix("template:"))
    from transformers import AutoTokenizer

    if request.param.startswith("builtin:"):
        name, _, folder = request.param.removeprefix("builtin:").partition("@")
        if not folder:
            return tiny_tokenizer_for_template(BUILTINS[name].file, chat_template=resolve_chat_template(name))
        real = AutoTokenizer.from_pretrained(folder)
        marker = {"chatml-hermes": "<|im_start|>", "gemma-hermes": "<start_of_turn>"}.get(name, "<|start_header_id|>")
        if len(real.encode(marker, add_special_tokens=False)) != 1:
            pytest.skip(f"{Path(folder).name} has no single token {marker}, which {name} writes")
        real.chat_template = resolve_chat_template(name)
        return real

    folder = Path(request.param)
    if not folder.is_dir():
        pytest.fail(f"AGENTLOOP_TOKENIZER_DIRS lists {folder}, which is not a folder")
    return AutoTokenizer.from_pretrained(str(folder))


def _supports_tools(tok) -> bool:
    marker = "tool-result-marker-42"
    try:
        text = tok.apply_chat_template(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": marker},
            ],
            tools=TOOLS,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:
        return False
    return marker in text and '"calc"' in text


@pytest.fixture(scope="module")
def tool_support(tok) -> bool:
    return _supports_tools(tok)


def engine_ids(renderer: ChatRenderer, context_ids: list[int], text: str, *, close: bool = True
               ) -> tuple[list[int], bool]:
    """Ids an engine would generate for ``text`` (+ EOS unless ``close`` is False: the text ends
    with its own closing token) after ``context_ids``.

    Uses the tokenization of the text in context when that leaves the context ids unchanged
    (what a model trained on canonical tokenizations emits); otherwise the text's own encoding,
    flagged non-canonical.
    """
    eos = [renderer.eos_token_id] if close else []
    joint = renderer.encode(renderer.decode(context_ids) + text)
    if joint[: len(context_ids)] == context_ids:
        ids = joint[len(context_ids) :] + eos
        # A tokenizer that cannot encode a character (SmolLM2's writes U+FFFD for U+40000) gives
        # ids whose decoded text encodes to other ids: not canonical either.
        whole = context_ids + ids
        return ids, renderer.encode(renderer.decode(whole)) == whole
    return renderer.encode(text) + eos, False


def logprobs_for(ids: list[int], turn: int) -> list[float]:
    return [-0.001 * (1 + (i + 7 * turn) % 50) for i in range(len(ids))]


def tool_call_text(arg: str) -> str:
    return '<tool_call>\n{"name": "calc", "arguments": ' + json.dumps({"x": arg}) + "}\n</tool_call>"


def assert_mask_invariant(traj: Trajectory, outputs: list[tuple[list[int], list[float]]]) -> None:
    n = len(traj.response_ids)
    assert len(traj.response_mask) == n
    assert len(traj.response_logprobs) == n
    generated = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 1]
    assert generated == [t for ids, _ in outputs for t in ids]
    lps = [lp for lp, m in zip(traj.response_logprobs, traj.response_mask, strict=True) if m == 1]
    assert lps == [lp for _, lp in outputs for lp in lp]
    assert all(lp == 0.0 for lp, m in zip(traj.response_logprobs, traj.response_mask, strict=True) if m == 0)


def full_reference(tok, messages, tools, add_generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tok.encode(text, add_special_tokens=False)


# Unicode, whitespace runs, newlines, combining marks (NFC changes them), emoji; no "<" so no
# text spells a special token.
_CHUNKS = st.one_of(
    st.text(st.characters(exclude_characters="<", exclude_categories=("Cs",)), max_size=4),
    st.sampled_from(
        ["\n", " ", "\t", "\r\n", "  ", "\n\n", "e\u0301", "\u4e2d\u6587", "\U0001f642", "#### 42"]
    ),
)
TEXT = st.lists(_CHUNKS, max_size=8).map("".join)
TURN = st.tuples(
    TEXT,  # assistant text
    st.booleans(),  # assistant makes a tool call
    st.one_of(
        st.lists(TEXT, min_size=1, max_size=3).map(lambda xs: [{"role": "tool", "content": x} for x in xs]),
        TEXT.map(lambda x: [{"role": "user", "content": x}]),
    ),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=TEXT,
    question=TEXT,
    turns=st.lists(TURN, min_size=1, max_size=8),
    end_with_assistant=st.booleans(),
    split_tool_messages=st.booleans(),
)
def test_delta_equals_full_tokenization(
    tok, tool_support, system, question, turns, end_with_assistant, split_tool_messages
):
    tools = TOOLS if tool_support else None
    renderer = ChatRenderer(tok, tools=tools)
    written = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    traj = Trajectory(renderer, written)
    assert traj.prompt_ids == full_reference(tok, traj.messages, tools, True)
    outputs, all_canonical = [], True
    for k, (text, call, follow) in enumerate(turns):
        if not tool_support:
            call, follow = False, [{"role": "user", "content": m["content"]} for m in follow[:1]]
        # The engine writes what the template renders for the turn (a think block, harmony's
        # final channel), closing token included.
        reply = {"role": "assistant", "content": text + (tool_call_text(text) if call else "")}
        try:
            body = template_turn_text(renderer, written, reply)
        except TemplateTurnError:
            # Mistral renders the system prompt only in a last user message, so the turn's
            # render does not extend the generation prompt's: the engine writes the content.
            body = reply["content"] + renderer.eos_text
        ids, canonical = engine_ids(renderer, traj.context_ids, body, close=False)
        written.append(reply)
        all_canonical &= canonical
        lps = logprobs_for(ids, k)
        before = traj.context_ids
        message = traj.append_generated(TokenOutput(ids, lps))
        assert traj.context_ids == before + ids, "generated ids must be appended verbatim"
        assert message is traj.messages[-1]
        assert message["role"] == "assistant"
        outputs.append((ids, lps))
        if end_with_assistant and k == len(turns) - 1:
            break
        if split_tool_messages and len(follow) > 1:
            for m in follow:  # one call per tool result: the tail is re-rendered each time
                traj.append_messages([m])
        else:
            traj.append_messages(follow)
        written.extend(follow)
    assert_mask_invariant(traj, outputs)
    event(f"all generated turns canonical: {all_canonical}")
    strict = traj.sanity_check("strict")
    assert strict.ok, strict.describe()
    # Where one render of the conversation as written holds every turn as the engine saw and
    # wrote it (ChatML without reasoning), the trajectory is exactly its tokenization; where the
    # template rewrites earlier turns (Qwen3, gpt-oss, Mistral), the engine-view check above is
    # the reference.
    holds = one_render_holds(renderer, written)
    event(f"one render holds the conversation: {holds}")
    if holds and end_with_assistant:
        expected = full_reference(tok, written, tools, False)
        if all_canonical:
            # The trajectory stops right after the generated end of turn; the rest is glue.
            assert expected[: len(traj.context_ids)] == traj.context_ids
            assert renderer.decode(expected[len(traj.context_ids) :]).strip() == ""
    elif holds and all_canonical:
        assert traj.context_ids == full_reference(tok, written, tools, True)
    if all_canonical:
        assert strict.canonical is True
    output = traj.to_output(sanity_check="strict")
    assert output.response_ids == traj.response_ids
    assert output.num_turns == len(traj.messages)


def _check_delta_ids(tok) -> None:
    renderer = ChatRenderer(tok, tools=TOOLS)
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}])
    prompt_ids = list(traj.context_ids)
    ids, _ = engine_ids(renderer, traj.context_ids, tool_call_text("6*7"))
    traj.append_generated(TokenOutput(ids))
    new = [{"role": "tool", "content": "42"}]
    expected = renderer.delta_ids(traj.messages, new)
    assert traj.append_messages(new) == expected
    assert traj.response_ids[-len(expected) :] == expected
    text = renderer.decode(expected)
    assert "42" in text
    assert text.startswith(renderer.glue_after_assistant(True))
    # For every template: the context is the prompt, the engine's ids, then the delta.
    assert traj.context_ids == prompt_ids + ids + expected
    assert traj.sanity_check("strict").ok
    # One render of the whole conversation equals the trajectory only for a template that
    # renders an assistant turn as it was generated after its generation prompt. One that
    # rewrites history (QwQ's opens each generation with "<think>\n" and drops it from earlier
    # turns; others drop earlier reasoning) renders each turn's context differently from the
    # next turn's view of it: there the trajectory stays the engine's ids, as asserted above.
    generation_prompt = renderer.render_text(traj.messages[:1], add_generation_prompt=True)
    keeps_history = renderer.render_text(traj.messages[:2], add_generation_prompt=False).startswith(generation_prompt)
    whole = renderer.encode(renderer.render_text(traj.messages, add_generation_prompt=True))
    assert (whole == traj.context_ids) == keeps_history


def test_delta_ids_match_trajectory(tok, tool_support):
    if not tool_support:
        pytest.skip("this chat template does not render tools= / tool messages")
    _check_delta_ids(tok)


def test_delta_ids_match_trajectory_when_the_template_rewrites_history():
    """A QwQ-style template: the generation prompt opens a thinking block that the rendered
    history does not hold (the one render of the whole conversation is not the trajectory)."""
    template = resolve_chat_template("chatml-hermes")
    opening = "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    assert opening in template
    tok = tiny_tokenizer_for_template("qwq-style.jinja", chat_template=template.replace(
        opening, "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"))
    _check_delta_ids(tok)


def test_generation_without_eos_gets_full_turn_suffix(tok):
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "Count."}])
    ids = renderer.encode("one two three")  # stopped by max_tokens: no EOS
    traj.append_generated(TokenOutput(ids, stop_reason="length"))
    appended = traj.append_messages([{"role": "user", "content": "Go on."}])
    # The template's own close of the turn comes first (ChatML <|im_end|>; gpt-oss <|end|>, as
    # it closes a turn that messages follow), then the user turn.
    whole = renderer.render_text([{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three"},
                                  {"role": "user", "content": "Go on."}], add_generation_prompt=True)
    assert renderer.decode(appended) == whole[whole.rindex("one two three") + len("one two three"):]
    assert traj.sanity_check("strict").ok
    assert traj.response_logprobs is None  # no engine returned log-probs
    assert list(traj.response_mask) == [1] * len(ids) + [0] * len(appended)


def test_trajectory_may_end_after_truncated_generation(tok):
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "Count."}])
    traj.append_generated(TokenOutput(renderer.encode("one two"), stop_reason="length"))
    report = traj.sanity_check("strict")
    assert report.ok, report.describe()


def test_messages_before_first_generation_rerender_prompt(tok):
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    try:
        ids = traj.append_messages([{"role": "user", "content": "Are you there?"}])
    except Exception as exc:
        if template_refusal(exc) is None:
            raise
        pytest.skip(f"the chat template refuses two user messages in a row: {template_refusal(exc)}")
    assert ids == traj.prompt_ids == full_reference(tok, traj.messages, None, True)
    assert traj.response_ids == []


def test_bad_messages_are_rejected(tok):
    renderer = ChatRenderer(tok)
    with pytest.raises(ValueError, match="at least one prompt message"):
        Trajectory(renderer, [])
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    with pytest.raises(ValueError, match="append_generated"):
        traj.append_messages([{"role": "assistant", "content": "not generated"}])
    with pytest.raises(ValueError, match="no 'role'"):
        traj.append_messages([{"content": "x"}])
    with pytest.raises(ValueError, match="sanity_check must be one of"):
        traj.sanity_check("loose")


def test_mixed_logprobs_are_an_error(tok):
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    traj.append_generated(TokenOutput([renderer.eos_token_id]))
    traj.append_messages([{"role": "user", "content": "Again."}])
    with pytest.raises(ValueError, match="log-probs"):
        traj.append_generated(TokenOutput([renderer.eos_token_id], log_probs=[-0.1]))


def test_tokenizer_without_template_is_rejected():
    tok = load_tiny_tokenizer()
    tok2 = tok.__class__.from_pretrained(tok.name_or_path)
    tok2.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(tok2)


# A Qwen3-like template: reasoning is stripped from assistant turns before the last user
# message, so render(history) is not a prefix of render(history + user message).
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m.content or '' %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("inference_template", [False, True])
def test_reasoning_stripping_template_keeps_the_generated_reasoning(inference_template):
    tok = load_tiny_tokenizer()
    renderer = ChatRenderer(tok, chat_template=QWEN3_LIKE, use_inference_chat_template=inference_template)
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 2+2?"}])
    first = renderer.encode("<think>\nadd them\n</think>\n\nIt is 4.") + [renderer.eos_token_id]
    traj.append_generated(TokenOutput(first, [-0.2] * len(first)))
    traj.append_messages([{"role": "tool", "content": "4"}])
    # The user message makes the template strip the first turn's reasoning; the delta is cut
    # after the turn, so it holds only what the new messages add.
    delta = traj.append_messages([{"role": "tool", "content": "4"}, {"role": "user", "content": "And 3+3?"}])
    assert renderer.decode(delta) == (
        "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    second = renderer.encode("<think>\nagain\n</think>\n\n6") + [renderer.eos_token_id]
    traj.append_generated(TokenOutput(second, [-0.3] * len(second)))
    assert_mask_invariant(traj, [(first, [-0.2] * len(first)), (second, [-0.3] * len(second))])
    assert "add them" in renderer.decode(traj.context_ids)  # the generated reasoning is kept
    report = traj.sanity_check("strict")
    if inference_template:
        # An inference server would render the history without the first turn's reasoning.
        assert not report.ok
        assert "add them" in report.actual_text
        assert "add them" not in report.expected_text
        with pytest.raises(TokenizationMismatchError, match="MISMATCH"):
            traj.to_output(sanity_check="strict")
    else:
        assert report.ok, report.describe()
        assert traj.to_output().metrics.get("tokenization_mismatch") is None


def test_template_that_rewrites_everything_is_an_error_at_construction():
    tok = load_tiny_tokenizer()
    # Renders only the number of messages and the last content: an assistant turn followed by
    # anything is not in the render, so no delta can be cut from it.
    renderer_template = (
        "{{- messages | length }}{%- if add_generation_prompt %}>{%- endif %}{{- messages[-1].content }}"
    )
    with pytest.raises(TokenizationMismatchError, match="cannot be split into turns.*renders neither the content"):
        ChatRenderer(tok, chat_template=renderer_template)


class _ProcessorLike:
    """The surface of a transformers processor the renderer uses: its own
    apply_chat_template, and .tokenizer for encode/decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.rendered = 0

    def apply_chat_template(self, messages, **kwargs):
        self.rendered += 1
        return [self.tokenizer.apply_chat_template(messages, **kwargs)]  # batched, like some processors


def test_processor_renders_and_its_tokenizer_encodes():
    tok = load_tiny_tokenizer()
    processor = _ProcessorLike(tok)
    renderer = ChatRenderer(processor)
    assert renderer.tokenizer is tok
    messages = [{"role": "user", "content": "Hi."}]
    assert renderer.render_prompt(messages) == ChatRenderer(tok).render_prompt(messages)
    assert processor.rendered >= 2  # the probe and the prompt went through the processor


@pytest.mark.parametrize("inference_template", [False, True])
def test_apply_chat_template_kwargs_reach_the_template(inference_template):
    tok = load_tiny_tokenizer()
    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{%- endif %}"
    )
    renderer = ChatRenderer(
        tok,
        chat_template=template,
        apply_chat_template_kwargs={"enable_thinking": False},
        use_inference_chat_template=inference_template,
    )
    assert renderer.generation_prompt_extra == "<think>\n\n</think>\n\n"
    traj = Trajectory(renderer, [{"role": "user", "content": "Hi."}])
    assert renderer.decode(traj.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    traj.append_generated(TokenOutput(renderer.encode("Hello.") + [renderer.eos_token_id]))
    delta = traj.append_messages([{"role": "user", "content": "Bye."}])
    assert renderer.decode(delta).endswith("<think>\n\n</think>\n\n")
    # The engine saw the empty think block before "Hello."; a history render drops it, which
    # only the inference view reports.
    assert traj.sanity_check("strict").ok is not inference_template




def _tool_turns(renderer, turns: int) -> Trajectory:
    traj = Trajectory(renderer, [{"role": "user", "content": "Add up the numbers."}])
    for k in range(turns):
        generated = renderer.encode(f"Calling the tool, turn {k}.") + [renderer.eos_token_id]
        traj.append_generated(TokenOutput(generated, [-0.1] * len(generated)))
        traj.append_messages([{"role": "tool", "content": str(k * 7)}])
    return traj


def test_auto_delta_turns_short_after_agreeing_and_gives_the_history_ids(monkeypatch):
    from agentloop_core.tokenization import renderer as renderer_module

    monkeypatch.setattr(renderer_module, "_SHORT_DELTA_VERDICTS", {})
    tok = load_tiny_tokenizer()
    monkeypatch.setattr(ChatRenderer(tok, tools=TOOLS)._frames, "off", "this test counts short renders")  # no frames
    exact = _tool_turns(ChatRenderer(tok, tools=TOOLS, delta_strategy="history"), 12)
    auto_renderer = ChatRenderer(tok, tools=TOOLS)
    rendered: list[int] = []
    original = auto_renderer.render_text

    def counting(messages, **kw):
        rendered.append(len(messages))
        return original(messages, **kw)

    monkeypatch.setattr(auto_renderer, "render_text", counting)
    auto = _tool_turns(auto_renderer, 12)
    during = list(rendered)
    assert auto.context_ids == exact.context_ids
    assert auto.response_mask == exact.response_mask
    assert auto.sanity_check("strict").ok
    # Verification renders the whole history; after VERIFY_DELTAS agreeing deltas each render
    # holds the fixed user message + the last assistant turn (+ the tool message): at most 3.
    assert max(during[-2 * 4:]) <= 3
    assert max(during) > 3
    # A second renderer of the same template (loops build one per trajectory) trusts the verdict.
    fresh = ChatRenderer(tok, tools=TOOLS)
    lengths: list[int] = []
    fresh_render = fresh.render_text
    monkeypatch.setattr(fresh, "render_text", lambda messages, **kw: (lengths.append(len(messages)),
                                                                       fresh_render(messages, **kw))[1])
    _tool_turns(fresh, 3)
    assert lengths
    assert max(lengths[1:]) <= 3


def test_auto_delta_keeps_the_history_render_for_a_template_that_looks_further_back(monkeypatch):
    from agentloop_core.tokenization import renderer as renderer_module

    monkeypatch.setattr(renderer_module, "_SHORT_DELTA_VERDICTS", {})
    tok = load_tiny_tokenizer()
    auto = _tool_turns(ChatRenderer(tok, chat_template=COUNTING_TOOL_RESULTS_TEMPLATE), 6)
    assert "#6 35" in auto.renderer.decode(auto.context_ids)  # numbered over the whole conversation
    assert auto.sanity_check("strict").ok
    assert list(renderer_module._SHORT_DELTA_VERDICTS.values()) == [-1]  # pinned to history
    # Forcing the short render on such a template is caught by the strict sanity check.
    short = _tool_turns(ChatRenderer(tok, chat_template=COUNTING_TOOL_RESULTS_TEMPLATE, delta_strategy="short"), 3)
    report = short.sanity_check("strict")
    assert not report.ok
    assert "#2" in report.expected_text
    with pytest.raises(ValueError, match="delta_strategy='shortest'; use one of auto, history, short"):
        ChatRenderer(tok, delta_strategy="shortest")
