"""``tool_agent`` end to end with gpt-oss (harmony) and Mistral tool calls, on a scripted engine.

The engine writes each family's call markup as the model would; the loop parses it with the
matching parser (``gpt_oss``, ``mistral``), runs the tool, and renders the tool result with the
family's chat template. These templates render a tool result only after the assistant turn
that called the tool (gpt-oss names the function in the result's header, Mistral checks the
9-character call ids and the user/assistant alternation), so they pass only when the loop
attaches the turn's calls (``Trajectory.attach_tool_calls``) and gives the tool messages the
right ``name`` and ``tool_call_id``. Every trajectory goes through the strict sanity check.

Each family runs on its real chat template from ``../shared/data/chat_templates`` (skipped with
a reason when that folder is absent, as in a fresh clone) and on a small inline template with
the same behaviour, so the coverage does not depend on ``../shared``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.function_tool import function_tool
from agentloop_tools.interaction import BaseInteraction

SHARED_TEMPLATES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates"
PROMPT = [{"role": "user", "content": "What is 6 times 7?"}]
SAMPLING = {"temperature": 0.0, "logprobs": True}

# Behaves like openai-gpt-oss-120b.jinja where tool_agent meets it: tools in a developer message,
# assistant content holding channel tags refused, a tool call rendered from tool_calls[0], a tool
# result refused unless an assistant turn with tool_calls came before it and headed with that
# call's function name, earlier final answers closed with <|end|> and only a trailing one with
# <|return|>, and the generation prompt <|start|>assistant.
HARMONY_LIKE = (
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools' }}"
    "{%- for tool in tools %}{{- '\\n// ' + tool.function.description + '\\ntype ' + tool.function.name + ' = (_: '"
    " + tool.function.parameters | tojson + ') => any;' }}{%- endfor %}{{- '<|end|>' }}{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if '<|channel|>' in (message.content or '') %}"
    "{{- raise_exception('You have passed a message containing <|channel|> tags in the content field.') }}"
    "{%- endif %}"
    "{%- if message.tool_calls %}{%- set call = message.tool_calls[0].function %}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>'"
    " + call.arguments | tojson + '<|call|>' }}{%- set last.name = call.name %}"
    "{%- elif loop.last and not add_generation_prompt %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- set last.name = none %}{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if last.name is none %}"
    "{{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}"
    "{%- endif %}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>'"
    " + message.content | tojson + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# Behaves like mistralai-Mistral-Nemo-Instruct-2407.jinja: user/assistant alternation checked
# (tool messages and assistant turns with tool_calls skipped), tools before the last user
# message, tool calls and results refused unless their ids have 9 characters, no generation
# prompt.
MISTRAL_LIKE = (
    "{%- set ns = namespace(index=0) %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'tool' or (message.tool_calls is defined and message.tool_calls is not none)) %}"
    "{%- if (message.role == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- set ns.index = ns.index + 1 %}{%- endif %}{%- endfor %}"
    "{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and message == user_messages[-1] %}"
    "{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + message.content + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS][' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- (call.function | tojson)[:-1] + ', \"id\": \"' + call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}{{- message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_RESULTS]{\"content\": ' + message.content | string + ', \"call_id\": \"' + message.tool_call_id"
    " + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)

FAMILIES = {
    "gpt_oss": ("openai-gpt-oss-120b.jinja", HARMONY_LIKE),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL_LIKE),
}

HARMONY_CALL = ('<|channel|>analysis<|message|>Multiply them.<|end|><|start|>assistant to=functions.calc'
                '<|channel|>commentary json<|message|>{"x": "6*7"}<|call|>')
HARMONY_FINAL = "<|channel|>final<|message|>42<|return|>"
HARMONY_RESULT = '<|start|>functions.calc to=assistant<|channel|>commentary<|message|>"42"<|end|><|start|>assistant'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "calc", "arguments": {"x": "6*7"}, "id": "a1b2c3d4e"}]</s>'
MISTRAL_FINAL = "6 times 7 is 42.</s>"


def mistral_result(call_id: str, content: str = "42") -> str:
    return f'[TOOL_RESULTS]{{"content": {content}, "call_id": "{call_id}"}}[/TOOL_RESULTS]'


@function_tool
def calc(x: str) -> str:
    """Multiply two integers.

    Args:
        x: Two integers joined by '*', like "6*7".
    """
    a, b = x.split("*")
    return str(int(a) * int(b))


def family_tokenizer(family: str, source: str) -> Any:
    """The tiny tokenizer with the family's special tokens (gpt-oss ends answers with <|return|>,
    Mistral turns with </s>) and its real (``shared``) or inline (``inline``) chat template."""
    shared_name, inline = FAMILIES[family]
    path = SHARED_TEMPLATES / shared_name
    if source == "shared":
        if not path.is_file():
            pytest.skip(f"{path} is absent (a fresh clone has no ../shared); the inline variant covers the behaviour")
        return tiny_tokenizer_for_template(path)
    return tiny_tokenizer_for_template(path, chat_template=inline)


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def scripted(tok: Any, turns: list[str]) -> ScriptedServer:
    """An engine that writes ``turns[i]`` on its i-th call, stopping at EOS or a request's stop ids."""
    return ScriptedServer(lambda rid, prompt, i: encode(tok, turns[min(i, len(turns) - 1)]), vocab_size=len(tok),
                          eos_token_id=tok.eos_token_id, append_eos=True)


async def run_loop(tok: Any, parser: str, turns: list[str], **config: Any) -> tuple[ScriptedServer, Any]:
    server = scripted(tok, turns)
    loop = ToolAgentLoop(server, tok, {"tools": {"calc": calc}, "tool_parser": parser, "response_length": 4096,
                                       "sanity_check": "strict", **config})
    out = await loop.run(SAMPLING, raw_prompt=PROMPT, request_id="r1")
    return server, out


def runs(out: Any, value: int) -> list[list[int]]:
    """The maximal runs of response ids whose mask is ``value``, in order."""
    found: list[list[int]] = []
    previous = None
    for token, mask in zip(out.response_ids, out.response_mask, strict=True):
        if mask == value:
            if previous != value:
                found.append([])
            found[-1].append(token)
        previous = mask
    return found


def check_trajectory(tok: Any, server: ScriptedServer, out: Any, turns: list[str], between: list[str]) -> None:
    """Masks are 1 exactly on the scripted ids, which the engine returned verbatim; the ids between
    the turns (mask 0) are exactly ``between``; every generate call continued the context it was
    given; the context holds prompt + response."""
    assert [c.output.token_ids for c in server.calls] == [encode(tok, t) for t in turns]
    assert runs(out, 1) == [encode(tok, t) for t in turns]
    assert [tok.decode(r) for r in runs(out, 0)] == between
    assert out.response_mask[0] == 1
    assert out.response_mask[-1] == 1
    for prev, nxt in zip(server.calls, server.calls[1:], strict=False):
        seen = prev.prompt_ids + prev.output.token_ids
        assert nxt.prompt_ids[: len(seen)] == seen
    assert server.calls[0].prompt_ids == out.prompt_ids
    assert out.prompt_ids + out.response_ids == server.calls[-1].prompt_ids + server.calls[-1].output.token_ids
    assert out.response_logprobs is not None
    assert len(out.response_logprobs) == len(out.response_ids)
    assert "tokenization_mismatch" not in out.metrics


def tool_messages(out: Any) -> list[dict[str, Any]]:
    return [m for m in out.extra_fields["messages"] if m["role"] == "tool"]


# --- gpt-oss (harmony) -------------------------------------------------------------------------


@pytest.mark.parametrize("delta_strategy", ["auto", "history", "short"])
@pytest.mark.parametrize("source", ["shared", "inline"])
async def test_gpt_oss_call_then_final_answer(source, delta_strategy):
    """The call turn stops at <|call|>; the loop runs calc and renders its result under the
    called function's name (only possible with the calls attached to the turn); the final answer
    ends at <|return|> and the strict check passes."""
    tok = family_tokenizer("gpt_oss", source)
    server, out = await run_loop(tok, "gpt_oss", [HARMONY_CALL, HARMONY_FINAL], delta_strategy=delta_strategy)

    check_trajectory(tok, server, out, [HARMONY_CALL, HARMONY_FINAL], [HARMONY_RESULT])
    assert tok.decode(server.calls[1].prompt_ids).endswith(HARMONY_CALL + HARMONY_RESULT)
    assert server.calls[0].output.token_ids[-1] == tok.convert_tokens_to_ids("<|call|>")
    assert server.calls[1].output.token_ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|return|>")
    assert tool_messages(out) == [{"role": "tool", "name": "calc", "tool_call_id": "call_1_call_0", "content": "42"}]
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["parse_errors"] == 0
    assert out.metrics["tool_errors"] == 0
    assert out.metrics["assistant_turns"] == 2
    assert out.extra_fields["termination_reason"] == "no_tool_call"


@pytest.mark.parametrize("source", ["shared", "inline"])
async def test_gpt_oss_call_to_an_unknown_tool_is_answered_with_an_error(source):
    """A call to a tool the loop does not have is a parse error; its error message is rendered as
    the result of that call (the template takes the name from the attached call)."""
    tok = family_tokenizer("gpt_oss", source)
    bad = HARMONY_CALL.replace("functions.calc", "functions.nope")
    server, out = await run_loop(tok, "gpt_oss", [bad, HARMONY_FINAL])

    [message] = tool_messages(out)
    assert message["name"] == "nope"
    assert message["tool_call_id"] == ""
    assert message["content"].startswith("Error: unknown tool 'nope'")
    result = ("<|start|>functions.nope to=assistant<|channel|>commentary<|message|>"
              f"{json.dumps(message['content'])}<|end|><|start|>assistant")
    check_trajectory(tok, server, out, [bad, HARMONY_FINAL], [result])
    assert out.metrics["parse_errors"] == 1
    assert out.metrics["tool_calls"] == 0


@pytest.mark.parametrize("source", ["shared", "inline"])
async def test_gpt_oss_call_without_a_function_name_is_answered_with_an_error(source):
    """A call addressed to ``functions.`` names no tool, so its tool message has no name to stand
    in for the call; the attached call (name "") still lets the template render the error."""
    tok = family_tokenizer("gpt_oss", source)
    bad = HARMONY_CALL.replace("functions.calc", "functions.")
    server, out = await run_loop(tok, "gpt_oss", [bad, HARMONY_FINAL])

    [message] = tool_messages(out)
    assert message["name"] == ""
    assert message["content"].startswith("Error: the tool call names no tool")
    result = ("<|start|>functions. to=assistant<|channel|>commentary<|message|>"
              f"{json.dumps(message['content'])}<|end|><|start|>assistant")
    check_trajectory(tok, server, out, [bad, HARMONY_FINAL], [result])
    assert out.metrics["parse_errors"] == 1


# --- Mistral -----------------------------------------------------------------------------------


@pytest.mark.parametrize("delta_strategy", ["auto", "history", "short"])
@pytest.mark.parametrize("source", ["shared", "inline"])
async def test_mistral_call_then_final_answer(source, delta_strategy):
    """The call turn ends at </s>; the tool result is answered under the id the model wrote, so the
    template's id check passes, and the final answer (an assistant turn after a tool-call turn)
    passes its alternation check; the strict check passes."""
    tok = family_tokenizer("mistral", source)
    server, out = await run_loop(tok, "mistral", [MISTRAL_CALL, MISTRAL_FINAL], delta_strategy=delta_strategy)

    check_trajectory(tok, server, out, [MISTRAL_CALL, MISTRAL_FINAL], [mistral_result("a1b2c3d4e")])
    assert tok.decode(server.calls[1].prompt_ids).endswith(MISTRAL_CALL + mistral_result("a1b2c3d4e"))
    assert [c.output.token_ids[-1] for c in server.calls] == [tok.eos_token_id] * 2
    assert tool_messages(out) == [{"role": "tool", "name": "calc", "tool_call_id": "a1b2c3d4e", "content": "42"}]
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["parse_errors"] == 0
    assert out.metrics["tool_errors"] == 0
    assert out.extra_fields["termination_reason"] == "no_tool_call"


@pytest.mark.parametrize("source", ["shared", "inline"])
async def test_mistral_call_without_an_id_gets_a_nine_character_id(source):
    """Older Mistral models write no id: the loop makes a 9-character one that the template
    accepts; two calls in one turn get distinct ids, answered in order."""
    tok = family_tokenizer("mistral", source)
    calls = ('[TOOL_CALLS][{"name": "calc", "arguments": {"x": "6*7"}}, '
             '{"name": "calc", "arguments": {"x": "2*3"}}]</s>')
    server, out = await run_loop(tok, "mistral", [calls, MISTRAL_FINAL])

    assert [(m["tool_call_id"], m["content"]) for m in tool_messages(out)] == [("call00100", "42"), ("call00101", "6")]
    check_trajectory(tok, server, out, [calls, MISTRAL_FINAL],
                     [mistral_result("call00100") + mistral_result("call00101", "6")])
    assert out.metrics["tool_calls"] == 2


@pytest.mark.parametrize("source", ["shared", "inline"])
async def test_mistral_call_ids_the_template_refuses_are_replaced(source):
    """A model id the template would refuse (not 9 characters) and a call the parser cannot use
    (unknown tool, so no usable id) are answered under ids the loop makes; the template accepts
    them and the trajectory passes the strict check."""
    tok = family_tokenizer("mistral", source)
    calls = ('[TOOL_CALLS][{"name": "calc", "arguments": {"x": "6*7"}, "id": "short"}, '
             '{"name": "nope", "arguments": {}, "id": "a1b2c3d4e"}]</s>')
    server, out = await run_loop(tok, "mistral", [calls, MISTRAL_FINAL])

    messages = tool_messages(out)
    assert [(m["name"], m["tool_call_id"]) for m in messages] == [("calc", "call00100"), ("nope", "call00101")]
    assert messages[0]["content"] == "42"
    assert messages[1]["content"].startswith("Error: unknown tool 'nope'")
    check_trajectory(tok, server, out, [calls, MISTRAL_FINAL],
                     [mistral_result("call00100") + mistral_result("call00101", messages[1]["content"])])
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["parse_errors"] == 1


# --- a user follow-up -----------------------------------------------------------------------------


class FollowUp(BaseInteraction):
    """Asks one follow-up question after the first answer, then ends."""

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self.state(instance_id)
        state["replies"] = state.get("replies", 0) + 1
        if state["replies"] == 1:
            return False, "And plus one?", 0.0, {}
        return True, "", 1.0, {}


@pytest.mark.parametrize("source", ["shared", "inline"])
@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])
async def test_user_follow_up_after_a_tool_call(family, source):
    """call -> tool result -> answer -> user follow-up -> answer: the follow-up is rendered after
    the answer (for Mistral the alternation check counts the answers, not the call turn) and the
    strict check passes over all three generated turns."""
    tok = family_tokenizer(family, source)
    if family == "gpt_oss":
        turns = [HARMONY_CALL, HARMONY_FINAL, "<|channel|>final<|message|>43<|return|>"]
        between = [HARMONY_RESULT, "<|start|>user<|message|>And plus one?<|end|><|start|>assistant"]
    else:
        turns = [MISTRAL_CALL, MISTRAL_FINAL, "Plus one is 43.</s>"]
        between = [mistral_result("a1b2c3d4e"), None]
    server, out = await run_loop(tok, family, turns, interaction=FollowUp())

    zeros = [tok.decode(r) for r in runs(out, 0)]
    if family == "mistral":
        # Tools are rendered before the last user message, so they come again before the follow-up.
        assert zeros[1].startswith("[AVAILABLE_TOOLS]")
        assert zeros[1].endswith("[/AVAILABLE_TOOLS][INST]And plus one?[/INST]")
        between[1] = zeros[1]
    check_trajectory(tok, server, out, turns, between)
    roles = [m["role"] for m in out.extra_fields["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert out.metrics["user_turns"] == 1
    assert out.metrics["assistant_turns"] == 3
    assert out.extra_fields["termination_reason"] == "interaction"
    assert out.extra_fields["turn_scores"] == [0.0, 1.0]


# --- hermes keeps its ids ---------------------------------------------------------------------------


async def test_hermes_tool_messages_keep_their_ids():
    """The default ids are unchanged: call_<turn>_call_<i> for usable calls, "" for a call the parser
    could not use; tool messages carry the function name."""
    tok = load_tiny_tokenizer()
    first = ('<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>'
             '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    second = '<tool_call>\n{"name": "calc", "arguments": {"x": "2*3"}}\n</tool_call>'
    _, out = await run_loop(tok, "hermes", [first, second, "42 and 6."])
    assert [(m["name"], m["tool_call_id"], m["content"][:20]) for m in tool_messages(out)] == [
        ("calc", "call_1_call_0", "42"), ("nope", "", "Error: unknown tool "), ("calc", "call_2_call_0", "6")]
