"""Tool-call parsers for gpt-oss (``gpt_oss`` / ``harmony``) and Mistral (``mistral``).

Exact parses, malformed calls as errors, fuzzing (never raise), round trips through the real
chat templates in ``../shared/data/chat_templates`` (skipped when that folder is absent), and
``tool_agent`` on a scripted engine with a tiny tokenizer that has each family's special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.parsers import (
    GptOssToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCall,
    UnknownToolParserError,
    check_arguments,
    get_tool_parser,
    register_tool_parser,
    tool_parameters,
    tool_parser_names,
)
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.function_tool import function_tool
from agentloop_tools.per_tokenizer import stop_token_ids

TEMPLATES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates"
GPT_OSS_TEMPLATE = "openai-gpt-oss-120b.jinja"
MISTRAL_TEMPLATE = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"]
MISTRAL_TOKENS = ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                  "[INST]", "[/INST]"]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["c", "f"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}


def template(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (a fresh clone has no ../shared); the real-template tests need it")
    return path.read_text()


def tokenizer_with(tokens: list[str], **named: str) -> Any:
    """The tiny tokenizer plus ``tokens`` as special tokens (single ids, dropped by
    ``skip_special_tokens=True`` like the real ones), and optional named tokens (bos/eos)."""
    from transformers import AddedToken

    tok = load_tiny_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)
    if named:
        tok.add_special_tokens(named)
    return tok


@pytest.fixture(scope="module")
def harmony_tokenizer():
    return tokenizer_with(HARMONY_TOKENS)


@pytest.fixture(scope="module")
def mistral_tokenizer():
    return tokenizer_with(MISTRAL_TOKENS)


def harmony_call(name: str, arguments: Any, *, start: bool = False, end: str = "<|call|>") -> str:
    """One tool-call message as gpt-oss writes it (recipient after the channel)."""
    head = "<|start|>assistant" if start else ""
    return (f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(arguments)}{end}")


def mistral_calls(*calls: tuple[str, Any], ids: bool = True) -> str:
    items = [{"name": n, "arguments": a, **({"id": f"abc{i:03d}XYZ"} if ids else {})} for i, (n, a) in enumerate(calls)]
    return "[TOOL_CALLS]" + json.dumps(items)


# --- registry ------------------------------------------------------------------------------


def test_registered_by_name_with_harmony_as_an_alias():
    """gpt_oss and mistral resolve by name; harmony is the same parser (one shared instance, so
    one set of counters). A failure here means the modules are not imported in parsers/__init__."""
    assert {"gpt_oss", "harmony", "mistral", "hermes", "llama3_json"} <= set(tool_parser_names())
    assert isinstance(get_tool_parser("gpt_oss"), GptOssToolParser)
    assert get_tool_parser("harmony") is get_tool_parser("gpt_oss")
    assert get_tool_parser("harmony").name == "gpt_oss"
    assert isinstance(get_tool_parser("mistral"), MistralToolParser)
    with pytest.raises(UnknownToolParserError, match=r"harmony \(alias of gpt_oss\).*mistral"):
        get_tool_parser("openai")


def test_an_alias_cannot_take_a_registered_name():
    """An alias is a name like any other: it may not shadow another parser."""
    with pytest.raises(ValueError, match="'hermes' is already registered by .*HermesToolParser"):
        @register_tool_parser("not_hermes", aliases=("hermes",))
        class _Clash(HermesToolParser):
            pass
    assert "not_hermes" not in tool_parser_names()


def test_stop_tokens_and_decode_flags():
    """<|call|> hands over to the tool and <|return|> ends the answer; <|end|> closes messages
    inside a turn and must not stop it. Mistral ends every turn with EOS. Only parsers whose markup
    is special tokens ask the loop to keep them."""
    assert GptOssToolParser.stop_tokens == ("<|call|>", "<|return|>")
    assert MistralToolParser.stop_tokens == ()
    assert GptOssToolParser.needs_special_tokens
    assert MistralToolParser.needs_special_tokens
    assert not HermesToolParser.needs_special_tokens
    assert not Llama3JsonToolParser.needs_special_tokens


def test_stop_tokens_are_single_tokens(harmony_tokenizer):
    """The loop passes stop tokens by id, so each must be one token of the tokenizer."""
    ids = stop_token_ids(harmony_tokenizer, GptOssToolParser.stop_tokens)
    assert len(ids) == 2
    assert [harmony_tokenizer.encode(t, add_special_tokens=False) for t in GptOssToolParser.stop_tokens] == [[i] for i in ids]


# --- harmony: exact parses -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        # As gpt-oss generates after the <|start|>assistant generation prompt.
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        # As the chat template renders history: recipient before the channel, bare content type.
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        # Arguments written as a JSON string.
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"{\\"city\\": \\"Paris\\"}"<|call|>',
        # A call closed with <|end|> (what openai-harmony accepts too).
        '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|end|>',
    ],
)
def test_harmony_single_call(text):
    """Each header style gpt-oss writes gives the same call; if one fails, check _recipient and _split."""
    result = GptOssToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": "Paris"})]
    assert result.content == ""


def test_harmony_reasoning_then_call():
    """The analysis message is reasoning: not content, not a call."""
    text = ("<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
            + harmony_call("get_weather", {"city": "Paris", "unit": "c"}, start=True))
    result = GptOssToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": "Paris", "unit": "c"})]
    assert result.content == ""


def test_harmony_several_calls_with_a_preamble():
    """Several call messages in one generation come back in order; a commentary preamble without
    a recipient is content (users see it), analysis is not."""
    text = ("<|channel|>analysis<|message|>Two lookups.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
            + harmony_call("get_weather", {"city": "Paris"}, start=True, end="<|end|>")
            + harmony_call("get_time", {"city": "Rome"}, start=True))
    result = GptOssToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": "Paris"}),
                            ToolCall("call_1", "get_time", {"city": "Rome"})]
    assert result.content == "Checking both."


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
         "It is 4."),
        ("<|channel|>final<|message|>It is 4.", "It is 4."),  # ended without an end token: still content
        ("The answer is 4.", "The answer is 4."),  # no harmony structure at all
        # A tool's reply the model wrote itself addresses the assistant, not a tool.
        ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>", "sunny"),
        ("", ""),
    ],
)
def test_harmony_no_call_is_content(text, content):
    """Turns without a recipient are content (final channel, loose text), never an attempted call."""
    result = GptOssToolParser().parse(text, TOOLS)
    assert (result.content, result.calls, result.errors, result.attempted) == (content, [], [], False)


@pytest.mark.parametrize(
    ("text", "kind", "fragment"),
    [
        ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par<|call|>',
         "invalid_json", "not valid JSON"),
        ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
         "unclosed_tag", "never closed; end each tool call with <|call|>"),
        ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|start|>assistant<|channel|>final'
         '<|message|>Done.<|return|>', "unclosed_tag", "never closed"),
        ('<|channel|>commentary to=functions.get_weather <|constrain|>json{"city": "Paris"}<|call|>',
         "unclosed_tag", "has no <|message|>"),
        (harmony_call("rm_rf", {}), "unknown_tool", "available tools: get_time, get_weather"),
        (harmony_call("get_weather", {"city": 3}), "invalid_arguments", "arguments.city must be of type string"),
        (harmony_call("get_weather", {"city": "Paris", "unit": "k"}), "invalid_arguments", "must be one of"),
        (harmony_call("get_weather", {}), "invalid_arguments", "arguments.city is required"),
        (harmony_call("get_weather", ["Paris"]), "invalid_arguments", "must be a JSON object"),
        ("<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>", "missing_name", "names no tool"),
        # A built-in tool's recipient is its name; these tools have no "python".
        ("<|channel|>analysis to=python<|message|>print(1)<|call|>", "invalid_json", "call to python"),
        ('<|channel|>analysis to=python<|message|>{"code": "1"}<|call|>', "unknown_tool", "unknown tool 'python'"),
    ],
)
def test_harmony_malformed_calls_become_errors(text, kind, fragment):
    """Each broken call is one error of the right kind with a reason the model can act on."""
    result = GptOssToolParser().parse(text, TOOLS)
    assert result.calls == []
    assert [e.kind for e in result.errors] == [kind]
    assert fragment in result.errors[0].reason
    assert result.attempted


def test_harmony_valid_call_next_to_a_broken_one():
    """A broken call does not spoil a good one; its ``raw`` is the message as written."""
    text = harmony_call("get_weather", {"city": "Paris"}, end="<|end|>") + harmony_call("nope", {}, start=True)
    result = GptOssToolParser().parse(text, TOOLS)
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": "Paris"})]
    assert [(e.kind, e.name) for e in result.errors] == [("unknown_tool", "nope")]
    assert result.errors[0].raw == harmony_call("nope", {}, start=True)


# --- mistral: exact parses -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "model_id"),
    [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}]', "abc123XYZ"),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}]</s>', "abc123XYZ"),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None),  # older variants: no id
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]', None),
        ('[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris"}}', None),  # no list around one call
        # Ids the template would refuse are dropped (the loop makes a valid one).
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123"}]', None),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc_23XYZ"}]', None),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 123456789}]', None),
    ],
)
def test_mistral_single_call(text, model_id):
    """Every variant of one Nemo call (id or not, EOS or not, string arguments) gives the same call;
    the model's id is kept when it is 9 letters or digits."""
    result = MistralToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": "Paris"}, model_id=model_id)]
    assert result.content == ""


def test_mistral_makes_nine_character_ids():
    """Ids the loop makes for Mistral calls are 9 letters or digits, distinct per turn and index, and
    deterministic; every other parser keeps the call_<turn>_<id> form ("" for unusable calls)."""
    parser = MistralToolParser()
    made = {(turn, index): parser.make_call_id(turn, index) for turn in (1, 2, 35, 36, 1000) for index in range(40)}
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in made.values())
    assert len(set(made.values())) == len(made)
    assert made[(1, 0)] == "call00100"
    assert made[(36, 35)] == "call0100z"
    assert parser.make_call_id(1, 0) == MistralToolParser().make_call_id(1, 0)
    call = ToolCall("call_2", "get_weather", {"city": "Paris"})
    assert HermesToolParser().make_call_id(3, 2, call) == "call_3_call_2"
    assert GptOssToolParser().make_call_id(3, 2, call) == "call_3_call_2"
    assert HermesToolParser().make_call_id(3, 2) == ""


def test_mistral_parallel_calls_and_content():
    """Calls keep their order and get per-turn ids; text before [TOOL_CALLS] is content."""
    text = "Let me check. " + mistral_calls(("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})) + "</s>"
    result = MistralToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": "Paris"}, model_id="abc000XYZ"),
                            ToolCall("call_1", "get_time", {"city": "Rome"}, model_id="abc001XYZ")]
    assert result.content == "Let me check."


def test_mistral_tag_inside_a_string_argument_and_a_second_block():
    """[TOOL_CALLS] inside a string argument is JSON text, not a new block; a real second block is read."""
    text = (mistral_calls(("get_weather", {"city": "[TOOL_CALLS][]"}))
            + mistral_calls(("get_time", {"city": "Rome"}), ids=False))
    result = MistralToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert [(c.name, c.arguments) for c in result.calls] == [("get_weather", {"city": "[TOOL_CALLS][]"}),
                                                             ("get_time", {"city": "Rome"})]


@pytest.mark.parametrize(
    ("text", "calls", "kinds", "fragment"),
    [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', 0, ["invalid_json"], "not valid JSON"),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti', 1, ["invalid_json"],
         "not valid JSON"),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}', 1, ["unclosed_tag"], "never closed"),
        ("[TOOL_CALLS]", 0, ["invalid_json"], "must be followed by a JSON list"),
        ("[TOOL_CALLS]get_weather[ARGS]{}", 0, ["invalid_json"], "must be followed by a JSON list"),
        ("[TOOL_CALLS][]", 0, ["missing_name"], "empty list"),
        ('[TOOL_CALLS][1, {"arguments": {}}]', 0, ["missing_name", "missing_name"], "JSON object"),
        (mistral_calls(("rm_rf", {})), 0, ["unknown_tool"], "available tools: get_time, get_weather"),
        (mistral_calls(("get_weather", {"city": 3})), 0, ["invalid_arguments"], "must be of type string"),
        (mistral_calls(("get_weather", {"city": "Paris", "unit": "k"})), 0, ["invalid_arguments"], "must be one of"),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": "{oops"}]', 0, ["invalid_arguments"], "not valid JSON"),
        (mistral_calls(("get_weather", {"city": "Paris"})) + " and then", 1, ["trailing_text"], "after the tool calls"),
    ],
)
def test_mistral_malformed_calls_become_errors(text, calls, kinds, fragment):
    """Broken lists are errors of the right kind; complete items before the break are still calls."""
    result = MistralToolParser().parse(text, TOOLS)
    assert len(result.calls) == calls
    assert [e.kind for e in result.errors] == kinds
    assert fragment in result.errors[0].reason
    assert result.attempted


@pytest.mark.parametrize("text", ["The answer is 4.", "The answer is 4.</s>", '[{"name": "get_weather"}]', ""])
def test_mistral_no_tag_is_content(text):
    """Without [TOOL_CALLS] the turn is content (minus a trailing EOS), whatever it looks like."""
    result = MistralToolParser().parse(text, TOOLS)
    assert (result.content, result.calls, result.errors) == (text.removesuffix("</s>"), [], [])


# --- fuzzing: whatever the model writes, the parsers return, never raise -------------------

_fragments = st.sampled_from([
    *HARMONY_TOKENS, *MISTRAL_TOKENS, "</s>", "assistant", "commentary", "analysis", "final", " to=functions.",
    "to=functions.get_weather", "to=", "json", "{", "}", "[", "]", '"name"', '"arguments"', '"id"', ":", ",", '"',
    '"get_weather"', '"city"', '"Paris"', "1", "null", "true", "\\", "\n", " ", "NaN", "1e999", "[" * 50, "{" * 30,
])
_texts = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(_fragments, st.text(max_size=5)), max_size=40).map("".join),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
                 lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                 max_leaves=8).map(json.dumps).flatmap(
        lambda blob: st.sampled_from(["[TOOL_CALLS]", "<|channel|>commentary to=functions.get_weather<|message|>", ""])
        .map(lambda head: head + blob + "<|call|>")),
)


@settings(max_examples=300, deadline=None)
@given(text=_texts, parser=st.sampled_from([GptOssToolParser, MistralToolParser]))
def test_fuzz_parsers_never_raise(text, parser):
    """Random text, unicode and JSON fragments: the result is always well-formed and every call
    passed the schema check; an ``internal`` error would mean the parser raised."""
    result = parser().parse(text, TOOLS)
    assert all(e.kind != "internal" for e in result.errors), result.errors
    assert isinstance(result.content, str)
    for call in result.calls:
        assert call.name in TOOLS
        assert isinstance(call.arguments, dict)
        assert check_arguments(call.arguments, tool_parameters(TOOLS[call.name])) == []


# Argument text may hold anything but harmony's start and end tokens: the engine stops at the
# <|call|> token, and text spelling an end token cannot be told from the token in decoded text.
_values = st.lists(st.one_of(st.text(max_size=5), st.sampled_from(
    ["<|message|>", "<|channel|>", "<|constrain|>", " to=functions.x", *MISTRAL_TOKENS, "</s>", "]", "}"])),
    max_size=6).map("".join)


@settings(max_examples=100, deadline=None)
@given(city=_values, reasoning=_values)
def test_fuzz_harmony_roundtrip_of_valid_calls(city, reasoning):
    """Any argument text (markup included) after any reasoning comes back exactly."""
    text = f"<|channel|>analysis<|message|>{reasoning}<|end|>" + harmony_call("get_weather", {"city": city}, start=True)
    result = GptOssToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "get_weather", {"city": city})]


@settings(max_examples=100, deadline=None)
@given(cities=st.lists(_values, min_size=1, max_size=3), prose=_values)
def test_fuzz_mistral_roundtrip_of_valid_calls(cities, prose):
    """Any argument text and any prose before the calls come back exactly."""
    while "[TOOL_CALLS]" in prose:
        prose = prose.replace("[TOOL_CALLS]", "")
    result = MistralToolParser().parse(prose + mistral_calls(*(("get_time", {"city": c}) for c in cities)) + "</s>",
                                       TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall(f"call_{i}", "get_time", {"city": c}, model_id=f"abc{i:03d}XYZ")
                            for i, c in enumerate(cities)]
    assert result.content == prose.strip()


# --- round trip through the real chat templates ----------------------------------------------


def generated_text(tok: Any, chat_template: str, prompt: list[dict], reply: list[dict]) -> str:
    """What the model generates for ``reply``: the template's render of prompt + reply minus the
    render of prompt with the generation prompt."""
    before = tok.apply_chat_template(prompt, tools=list(TOOLS.values()), chat_template=chat_template,
                                     add_generation_prompt=True, tokenize=False)
    after = tok.apply_chat_template(prompt + reply, tools=list(TOOLS.values()), chat_template=chat_template,
                                    add_generation_prompt=False, tokenize=False)
    assert after.startswith(before), "the template does not extend the prompt with the reply"
    return after[len(before):]


def openai_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **({"id": call_id} if call_id else {})}


PROMPT = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.mark.parametrize(
    ("reply", "calls"),
    [
        ([{"role": "assistant", "tool_calls": [openai_call("get_weather", {"city": "Paris"})]}],
         [("get_weather", {"city": "Paris"})]),
        ([{"role": "assistant", "tool_calls": [openai_call("get_weather", json.dumps({"city": "Paris", "unit": "c"}))]}],
         [("get_weather", {"city": "Paris", "unit": "c"})]),
        ([{"role": "assistant", "thinking": "Look it up.", "tool_calls": [openai_call("get_weather", {"city": "Paris"})]}],
         [("get_weather", {"city": "Paris"})]),
        # The template renders one call per assistant message; two messages are two calls in one turn.
        ([{"role": "assistant", "tool_calls": [openai_call("get_weather", {"city": "Paris"})]},
          {"role": "assistant", "tool_calls": [openai_call("get_time", {"city": "Paris"})]}],
         [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]),
        ([{"role": "assistant", "thinking": "Easy.", "content": "Sunny, 14:00."}], []),
    ],
)
def test_gpt_oss_template_roundtrip(harmony_tokenizer, reply, calls):
    """The parser recovers the calls the real gpt-oss template writes, from text decoded with
    special tokens kept; decoded without them the structure is gone (why the loop keeps them)."""
    text = generated_text(harmony_tokenizer, template(GPT_OSS_TEMPLATE), PROMPT, reply)
    ids = harmony_tokenizer.encode(text, add_special_tokens=False)
    decoded = harmony_tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded == text
    result = GptOssToolParser().parse(decoded, TOOLS)
    assert result.errors == []
    assert [(c.name, c.arguments) for c in result.calls] == calls
    if not calls:
        assert result.content == "Sunny, 14:00."
    else:
        assert not GptOssToolParser().parse(harmony_tokenizer.decode(ids, skip_special_tokens=True), TOOLS).calls


@pytest.mark.parametrize(
    ("tool_calls", "calls"),
    [
        ([openai_call("get_weather", {"city": "Paris"}, "abc123XYZ")], [("get_weather", {"city": "Paris"})]),
        ([openai_call("get_weather", {"city": "Paris"}, "abc123XYZ"), openai_call("get_time", {"city": "Paris"}, "xyz987ABC")],
         [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]),
        ([openai_call("get_weather", json.dumps({"city": "Paris"}), "abc123XYZ")], [("get_weather", {"city": "Paris"})]),
    ],
)
def test_mistral_template_roundtrip(tool_calls, calls):
    """The parser recovers the calls the real Mistral Nemo template writes (9-character ids,
    arguments as an object or a JSON string), EOS included or not."""
    tok = tokenizer_with(MISTRAL_TOKENS, bos_token="<s>", eos_token="</s>")
    text = generated_text(tok, template(MISTRAL_TEMPLATE), PROMPT, [{"role": "assistant", "tool_calls": tool_calls}])
    assert text.startswith("[TOOL_CALLS][")
    assert text.endswith("]</s>")
    ids = tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids, skip_special_tokens=False)
    for turn in (decoded, decoded.removesuffix("</s>")):
        result = MistralToolParser().parse(turn, TOOLS)
        assert result.errors == []
        assert [(c.name, c.arguments) for c in result.calls] == calls
    assert not MistralToolParser().parse(tok.decode(ids, skip_special_tokens=True), TOOLS).attempted


# --- tool_agent on a scripted engine -----------------------------------------------------------


@function_tool
def get_weather(city: str, unit: str = "c") -> str:
    """Current weather in a city.

    Args:
        city: The city.
        unit: c or f.
    """
    return f"sunny in {city}"


def scripted(tok: Any, turns: list[str]) -> ScriptedServer:
    """An engine that says ``turns[i]`` on its i-th call, stopping at EOS or the request's stop ids."""
    return ScriptedServer(lambda rid, prompt, i: tok.encode(turns[min(i, len(turns) - 1)], add_special_tokens=False),
                          eos_token_id=tok.eos_token_id, append_eos=True, vocab_size=len(tok))


async def run_loop(tok: Any, parser: str, turns: list[str], **config: Any):
    server = scripted(tok, turns)
    loop = ToolAgentLoop(server, tok, {"tools": {"get_weather": get_weather}, "tool_parser": parser,
                                       "response_length": 2048, **config})
    out = await loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=PROMPT, request_id="r")
    return server, out


async def test_tool_agent_gpt_oss_stops_at_call_and_runs_the_tool(harmony_tokenizer):
    """tool_agent decodes harmony turns with special tokens kept, stops the first turn at <|call|>
    (the scripted text after it is never generated), runs the call and ends after the final
    answer's <|return|>. On the tiny ChatML template the strict tokenization check passes."""
    tok = harmony_tokenizer
    call_id, return_id = (tok.convert_tokens_to_ids(t) for t in ("<|call|>", "<|return|>"))
    first = ("<|channel|>analysis<|message|>Look it up.<|end|>" + harmony_call("get_weather", {"city": "Paris"}, start=True)
             + "<|start|>assistant<|channel|>final<|message|>Made up.<|return|>")
    final = "<|channel|>final<|message|>It is sunny in Paris.<|return|>"
    server, out = await run_loop(tok, "harmony", [first, final])

    assert {call_id, return_id} <= set(server.calls[0].sampling_params.stop_token_ids)
    assert server.calls[0].output.token_ids[-1] == call_id
    assert "Made up" not in tok.decode(server.calls[0].output.token_ids)
    assert server.calls[1].output.token_ids[-1] == return_id
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["parse_errors"] == 0
    assert out.metrics["tool_errors"] == 0
    assert [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"] == ["sunny in Paris"]
    assert out.extra_fields["termination_reason"] == "no_tool_call"
    generated = [t for c in server.calls for t in c.output.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1] == generated
    assert "tokenization_mismatch" not in out.metrics


async def test_tool_agent_mistral_runs_the_tool(mistral_tokenizer):
    """tool_agent keeps [TOOL_CALLS] when decoding, stops the call turn at EOS, runs the calls."""
    tok = mistral_tokenizer
    first = mistral_calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "unit": "f"}))
    server, out = await run_loop(tok, "mistral", [first + tok.eos_token + "Made up.", "It is sunny in both."])

    assert server.calls[0].output.token_ids[-1] == tok.eos_token_id
    assert "Made up" not in tok.decode(server.calls[0].output.token_ids)
    assert out.metrics["tool_calls"] == 2
    assert out.metrics["parse_errors"] == 0
    assert out.metrics["tool_errors"] == 0
    assert [(m["content"], m["tool_call_id"]) for m in out.extra_fields["messages"] if m["role"] == "tool"] == [
        ("sunny in Paris", "abc000XYZ"), ("sunny in Rome", "abc001XYZ")]  # the model's own ids
    assert out.extra_fields["termination_reason"] == "no_tool_call"
    assert "tokenization_mismatch" not in out.metrics


# tool_agent on the real gpt-oss and Mistral templates (and inline stand-ins), with the strict
# check: test_agent_loop_harmony_mistral.py.
