"""ToolAgentLoop ("tool_agent") on a scripted engine with the tiny tokenizer.

The engine is scripted so each test controls exactly what the "model" says; tokenization, the
chat template, the tools and the loop are all real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest

from agentloop_core.parsers import HermesToolParser, register_tool_parser
from agentloop_core.registry import get_agent_loop_class
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.tracing import Tracer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.base import BaseTool, ToolKwargsError
from agentloop_tools.builtin import calculator
from agentloop_tools.loop_config import ToolAgentConfig, check_loop_config_keys
from agentloop_tools.schema import ToolResponse
from agentloop_tools.truncation import truncate_text

PROMPT = [{"role": "user", "content": "Ann has 3 apples and buys 4 more. How many apples?"}]
SAMPLING = {"temperature": 0.0, "logprobs": True}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def schema(name: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}}}


class EchoTool(BaseTool):
    """Returns ``text`` (optionally after a delay) and a step reward of 0.1.

    ``in_flight`` counts the calls running right now (of every EchoTool sharing the same
    ``gauge`` list) and ``gauge[1]`` keeps the peak, so a test sees whether calls overlapped.
    """

    def __init__(self, name: str = "echo", delay_s: float = 0.0, reward: float = 0.1,
                 gauge: list[int] | None = None, **config: Any) -> None:
        super().__init__(config, schema(name, text="string"))
        self.delay_s = delay_s
        self.reward = reward
        self.gauge = gauge if gauge is not None else [0, 0]  # [in flight now, peak]

    async def execute(self, instance_id, parameters):
        self.state(instance_id)
        self.gauge[0] += 1
        self.gauge[1] = max(self.gauge[1], self.gauge[0])
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.gauge[0] -= 1
        return ToolResponse(text=parameters["text"]), self.reward, {}


class CounterTool(BaseTool):
    """Per-trajectory counter that starts at ``start`` (from tools_kwargs); reward = final count."""

    def __init__(self) -> None:
        super().__init__({}, schema("count", step="integer"))

    async def init_state(self, start: int = 0):
        return {"value": start}

    async def execute(self, instance_id, parameters):
        state = self.state(instance_id)
        await asyncio.sleep(0.001)  # yield, so concurrent trajectories interleave
        state["value"] += parameters["step"]
        return ToolResponse(text=str(state["value"])), 0.0, {}

    async def calc_reward(self, instance_id):
        return float(self.state(instance_id)["value"])


class BrokenTool(BaseTool):
    """``raise``: raises; ``hang``: sleeps an hour (``cancelled`` counts the sleeps cut short);
    anything else: returns junk instead of a result tuple."""

    def __init__(self, mode: str, **config: Any) -> None:
        super().__init__(config, schema(mode, text="string"))
        self.mode = mode
        self.cancelled = 0

    async def execute(self, instance_id, parameters):
        if self.mode == "raise":
            raise RuntimeError("disk on fire")
        if self.mode == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return "not a tuple"


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted(tokenizer, turns: list[str] | Callable[[str, list[int], int], str], **kw: Any) -> ScriptedServer:
    """An engine that says ``turns[i]`` on the i-th call of each request, ending with EOS."""

    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        text = turns(request_id, prompt_ids, index) if callable(turns) else turns[min(index, len(turns) - 1)]
        return tokenizer.encode(text, add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True, **kw)


def make_loop(server, tokenizer, tools: list[BaseTool], tracer=None, **config: Any) -> ToolAgentLoop:
    config.setdefault("response_length", 2048)
    return ToolAgentLoop(server, tokenizer, {"tools": {t.name: t for t in tools}, **config}, tracer=tracer)


def tool_messages(out) -> list[str]:
    return [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]


def test_registered_as_tool_agent():
    assert get_agent_loop_class("tool_agent") is ToolAgentLoop


async def test_mask_holds_exactly_the_engine_tokens_across_three_tool_turns(tokenizer):
    turns = [call("echo", text="one"), "Next. " + call("echo", text="two"), call("echo", text="three"),
             "The answer is 7.\n#### 7"]
    server = scripted(tokenizer, turns)
    tool = EchoTool()
    out = await make_loop(server, tokenizer, [tool]).run(SAMPLING, raw_prompt=PROMPT, request_id="r1")

    assert len(server.calls) == 4
    assert {c.request_id for c in server.calls} == {"r1"}  # one sticky id for every turn
    generated = [t for c in server.calls for t in c.output.token_ids]
    logprobs = [lp for c in server.calls for lp in c.output.log_probs]
    kept = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1]
    assert kept == generated
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 1] == logprobs
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 0)
    # Each turn's prompt is the previous context exactly: nothing re-encoded, nothing lost.
    for prev, nxt in itertools.pairwise(server.calls):
        assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.output.token_ids)] == prev.prompt_ids + prev.output.token_ids
    assert server.calls[0].prompt_ids == out.prompt_ids
    assert out.prompt_ids + out.response_ids == server.calls[-1].prompt_ids + server.calls[-1].output.token_ids
    assert tool_messages(out) == ["one", "two", "three"]
    assert out.metrics["tool_calls"] == 3
    assert out.metrics["tool_errors"] == 0
    assert out.metrics["assistant_turns"] == 4
    assert out.metrics["turns"] == 4
    assert out.extra_fields["termination_reason"] == "no_tool_call"
    assert out.extra_fields["tool_rewards"] == [0.1, 0.1, 0.1]
    assert out.extra_fields["turn_rewards"] == [0.1, 0.1, 0.1, 0.0]  # each call's reward on the turn that made it
    assert out.reward_score == pytest.approx(0.3)
    assert tool.live_instances == 0


@pytest.mark.parametrize(
    ("side", "expected"),
    [("left", "...(truncated)...56789"), ("right", "01234...(truncated)..."), ("middle", "01...(truncated)...789")],
)
def test_truncate_text_sides(side, expected):
    assert truncate_text("0123456789", 5, side) == expected
    assert truncate_text("0123", 5, side) == "0123"


@pytest.mark.parametrize("side", ["left", "right", "middle"])
async def test_long_tool_response_is_truncated_in_the_loop(tokenizer, side):
    long = "".join(str(i % 10) for i in range(200))
    server = scripted(tokenizer, [call("echo", text=long), "done"])
    loop = make_loop(server, tokenizer, [EchoTool()], max_tool_response_length=20, tool_response_truncate_side=side)
    out = await loop.run(SAMPLING, raw_prompt=PROMPT)
    assert tool_messages(out) == [truncate_text(long, 20, side)]


async def test_max_assistant_turns_stops_a_model_that_keeps_calling(tokenizer):
    server = scripted(tokenizer, [call("echo", text="again")])
    out = await make_loop(server, tokenizer, [EchoTool()], max_assistant_turns=3).run(SAMPLING, raw_prompt=PROMPT)
    assert len(server.calls) == 3
    assert out.metrics["tool_calls"] == 2  # the last turn's call is not run: nobody would read it
    assert out.extra_fields["termination_reason"] == "max_assistant_turns"
    assert out.response_mask[-1] == 1  # ends on the model's own tokens


async def test_parallel_calls_run_concurrently(tokenizer):
    gauge = [0, 0]
    tools = [EchoTool("slow_a", delay_s=0.2, gauge=gauge), EchoTool("slow_b", delay_s=0.2, gauge=gauge)]
    server = scripted(tokenizer, [call("slow_a", text="a") + call("slow_b", text="b"), "done"])
    out = await asyncio.wait_for(make_loop(server, tokenizer, tools).run(SAMPLING, raw_prompt=PROMPT), 60)
    assert tool_messages(out) == ["a", "b"]
    assert gauge == [0, 2], f"peak in-flight tool calls was {gauge[1]}: the two calls ran one after the other"
    assert out.metrics["tool_calls"] == 2
    assert "tool_calls_s" in out.metrics


async def test_calls_beyond_max_parallel_calls_get_an_error(tokenizer):
    server = scripted(tokenizer, [call("echo", text="1") + call("echo", text="2") + call("echo", text="3"), "ok"])
    out = await make_loop(server, tokenizer, [EchoTool()], max_parallel_calls=2).run(SAMPLING, raw_prompt=PROMPT)
    msgs = tool_messages(out)
    assert msgs[:2] == ["1", "2"]
    assert "too many tool calls in one turn (limit 2)" in msgs[2]
    assert out.metrics["tool_calls"] == 2
    assert out.metrics["tool_calls_over_limit"] == 1


@pytest.mark.fault
async def test_raising_hanging_and_junk_tools_become_error_text(tokenizer):
    tools = [BrokenTool("raise"), BrokenTool("hang", timeout_s=0.1), BrokenTool("junk"), EchoTool()]
    first = call("raise", text="x") + call("hang", text="x") + call("junk", text="x") + call("nope", text="x")
    server = scripted(tokenizer, [first, call("echo", text="still alive"), "done"])
    # wait_for only turns a hang into a failure; the checks are on what the timeout did.
    out = await asyncio.wait_for(make_loop(server, tokenizer, tools).run(SAMPLING, raw_prompt=PROMPT), 60)
    msgs = tool_messages(out)
    assert "failed: RuntimeError: disk on fire" in msgs[0]
    assert "timed out after 0.1 s" in msgs[1]
    assert tools[1].cancelled == 1, "the hung call was not cancelled when its timeout fired"
    assert "returned an invalid result" in msgs[2]
    assert "unknown tool 'nope'" in msgs[3]
    assert msgs[4] == "still alive"
    assert out.metrics["tool_errors"] == 3
    assert out.metrics["parse_errors"] == 1
    assert out.metrics["tool_calls"] == 4
    assert out.extra_fields["termination_reason"] == "no_tool_call"
    assert all(t.live_instances == 0 for t in tools)


class ReportingTool(BaseTool):
    """Reports what it did as metrics: numbers, a bool, a string, or (mode "bad") not a dict."""

    def __init__(self, mode: str = "good") -> None:
        super().__init__({}, schema("report", text="string"))
        self.mode = mode

    async def execute(self, instance_id, parameters):
        metrics = {"rows": len(parameters["text"]), "cache_hit": parameters["text"] == "bb", "source": "db"}
        return ToolResponse(text="ok"), 0.0, metrics if self.mode == "good" else ["rows", 3]


async def test_tool_metrics_add_up_per_trajectory_and_are_kept_whole(tokenizer):
    server = scripted(tokenizer, [call("report", text="aaa"), call("report", text="bb"), "done"])
    out = await make_loop(server, tokenizer, [ReportingTool()]).run(SAMPLING, raw_prompt=PROMPT)
    assert out.metrics["tool/report/rows"] == 5.0
    assert out.metrics["tool/report/cache_hit"] == 1.0
    assert "tool/report/source" not in out.metrics  # not a number: kept in extra_fields only
    reported = out.extra_fields["reported_metrics"]
    assert [r["turn"] for r in reported] == [1, 2]
    assert {r["source"] for r in reported} == {"tool/report"}
    assert reported[1]["metrics"] == {"rows": 2, "cache_hit": True, "source": "db"}

    server = scripted(tokenizer, [call("report", text="aaa"), "done"])
    bad = await make_loop(server, tokenizer, [ReportingTool("bad")]).run(SAMPLING, raw_prompt=PROMPT)
    assert tool_messages(bad) == ["ok"]  # the response still reaches the model
    assert bad.metrics["invalid_metrics"] == 1
    assert bad.metrics["tool_errors"] == 0
    assert bad.extra_fields["reported_metrics"][0]["metrics"] == {"invalid": "['rows', 3]"}


async def test_tool_timeout_from_config_applies_to_tools_without_their_own(tokenizer):
    server = scripted(tokenizer, [call("hang", text="x"), "done"])
    out = await make_loop(server, tokenizer, [BrokenTool("hang")], tool_timeout_s=0.05).run(SAMPLING, raw_prompt=PROMPT)
    assert "timed out after 0.05 s" in tool_messages(out)[0]


async def test_malformed_call_is_reported_to_the_model(tokenizer):
    server = scripted(tokenizer, ['<tool_call>{"name": "echo", "arguments": {"text": 5}}</tool_call>', "sorry"])
    out = await make_loop(server, tokenizer, [EchoTool()]).run(SAMPLING, raw_prompt=PROMPT)
    assert tool_messages(out) == ["Error: invalid arguments for 'echo': arguments.text must be of type string, got integer 5"]
    assert out.metrics["parse_errors"] == 1
    assert out.metrics["tool_calls"] == 0


async def test_budget_overflow_drops_the_tool_response_and_ends_cleanly(tokenizer):
    class LongTool(EchoTool):
        async def execute(self, instance_id, parameters):
            return ToolResponse(text=parameters["text"] * 100), 0.0, {}

    server = scripted(tokenizer, [call("echo", text="apples "), "never generated"])
    tool = LongTool()
    loop = make_loop(server, tokenizer, [tool], response_length=80, max_tool_response_length=10_000)
    out = await loop.run(SAMPLING, raw_prompt=PROMPT)
    assert len(server.calls) == 1
    assert server.calls[0].sampling_params.max_tokens == 80  # the whole budget, nothing more
    assert out.response_ids == server.calls[0].output.token_ids
    assert set(out.response_mask) == {1}
    assert out.extra_fields["termination_reason"] == "response_length"
    assert out.metrics["dropped_message_tokens"] > 0
    assert tool.live_instances == 0


async def test_max_tokens_is_the_remaining_budget_and_length_stops(tokenizer):
    server = scripted(tokenizer, [call("echo", text="hi"), "word " * 200])
    out = await make_loop(server, tokenizer, [EchoTool()], response_length=120).run(SAMPLING, raw_prompt=PROMPT)
    first, second = server.calls
    assert first.sampling_params.max_tokens == 120
    assert second.sampling_params.max_tokens == 120 - (len(second.prompt_ids) - len(first.prompt_ids))
    assert second.output.stop_reason == "length"
    assert len(out.response_ids) == 120
    assert out.extra_fields["termination_reason"] == "length"


async def test_state_is_isolated_across_50_concurrent_trajectories(tokenizer):
    counter = CounterTool()

    def turns(request_id: str, prompt_ids: list[int], index: int) -> str:
        k = int(request_id.split("-")[1])
        return call("count", step=k) if index < 3 else f"#### {k}"

    server = scripted(tokenizer, turns)
    loop = make_loop(server, tokenizer, [counter])
    outs = await asyncio.gather(*(
        loop.run(SAMPLING, raw_prompt=PROMPT, request_id=f"req-{k}", tools_kwargs={"count": {"create_kwargs": {"start": 1000 * k}}})
        for k in range(50)
    ))
    for k, out in enumerate(outs):
        assert tool_messages(out) == [str(1000 * k + k * i) for i in (1, 2, 3)]
        assert out.reward_score == 1000 * k + 3 * k
    assert counter.live_instances == 0


async def test_row_and_config_errors_are_clear(tokenizer):
    server = scripted(tokenizer, ["x"])
    loop = make_loop(server, tokenizer, [EchoTool()], prompt_length=5)
    with pytest.raises(ValueError, match="more than prompt_length=5"):
        await loop.run(SAMPLING, raw_prompt=PROMPT)
    with pytest.raises(ValueError, match=r"tools \['calc'\].*configured tools: \['echo'\]"):
        await make_loop(server, tokenizer, [EchoTool()]).run(SAMPLING, raw_prompt=PROMPT, tools_kwargs={"calc": {}})
    with pytest.raises(ValueError, match="raw_prompt"):
        await make_loop(server, tokenizer, [EchoTool()]).run(SAMPLING)
    with pytest.raises(ValueError, match="tool_response_truncate_side must be one of"):
        ToolAgentConfig.from_mapping({"tool_response_truncate_side": "top"})
    with pytest.raises(ValueError, match="max_parallel_calls must be a positive integer"):
        ToolAgentConfig.from_mapping({"max_parallel_calls": 0})
    with pytest.raises(ValueError, match="not a BaseTool"):
        ToolAgentLoop(server, tokenizer, {"tools": {"f": print}})


class RecordingTracer(Tracer):
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)


async def test_spans_and_reward_modes(tokenizer):
    tracer = RecordingTracer()
    server = scripted(tokenizer, [call("echo", text="a"), "done"])
    out = await make_loop(server, tokenizer, [EchoTool(reward=0.5)], tracer=tracer).run(SAMPLING, raw_prompt=PROMPT)
    assert [r["name"] for r in tracer.records] == ["generate", "tool:echo", "generate", "reward"]
    assert out.reward_score == 0.5
    server = scripted(tokenizer, [call("echo", text="a"), "done"])
    out = await make_loop(server, tokenizer, [EchoTool(reward=0.5)], tool_reward="none").run(SAMPLING, raw_prompt=PROMPT)
    assert out.reward_score is None
    assert out.extra_fields["tool_rewards"] == [0.5]


async def test_real_calculator_tool_over_three_turns(tokenizer):
    turns = [call("calculator", expression="3 + 4"), call("calculator", expression="7 * 6"),
             call("calculator", expression="1 / 0"), "#### 42"]
    server = scripted(tokenizer, turns)
    out = await make_loop(server, tokenizer, [calculator]).run(SAMPLING, raw_prompt=PROMPT)
    msgs = tool_messages(out)
    assert msgs[:2] == ["7", "42"]
    assert msgs[2].startswith("Error")
    assert "calculator" in msgs[2]
    assert out.metrics["tool_calls"] == 3
    assert out.metrics["tool_errors"] == 1
    assert calculator.live_instances == 0


@register_tool_parser("hermes_stop_after_call")
class _StopAfterCall(HermesToolParser):
    stop_tokens = ("</tool_call>", "<|not_in_vocab|>")


async def test_parser_stop_tokens_and_per_turn_max_tokens_reach_the_engine(tokenizer):
    server = scripted(tokenizer, [call("echo", text="a") + call("echo", text="b"), "done"])
    loop = make_loop(server, tokenizer, [EchoTool()], tool_parser="hermes_stop_after_call")
    out = await loop.run({"max_tokens": 50, "stop_token_ids": [7]}, raw_prompt=PROMPT)
    close_id = tokenizer.convert_tokens_to_ids("</tool_call>")
    first = server.calls[0]
    assert first.sampling_params.stop_token_ids == (7, close_id)  # tokens missing from the vocab are skipped
    assert first.sampling_params.max_tokens == 50
    assert first.output.token_ids[-1] == close_id  # the turn stopped after the first call
    assert tool_messages(out) == ["a"]
    assert out.extra_fields["termination_reason"] == "no_tool_call"


async def test_tools_from_a_function_tool_file_are_loaded_once(tokenizer, tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "from agentloop_tools.function_tool import function_tool\n\n"
        "@function_tool\n"
        "def shout(text: str) -> str:\n"
        '    """Upper-case the text.\n\n    Args:\n        text: What to shout.\n    """\n'
        "    return text.upper()\n"
    )
    server = scripted(tokenizer, [call("shout", text="hey"), "done"])
    config = {"function_tool_path": str(path), "response_length": 2048}
    loop = ToolAgentLoop(server, tokenizer, config)
    out = await loop.run(SAMPLING, raw_prompt=PROMPT)
    assert tool_messages(out) == ["HEY"]
    assert ToolAgentLoop(server, tokenizer, config).tools["shout"] is loop.tools["shout"]  # shared, not reloaded
    assert '"name": "shout"' in tokenizer.decode(out.prompt_ids)  # the schema reached the system prompt


class RecordingTool(BaseTool):
    """Records what every lifecycle stage receives from the row (verl-style ``**kwargs``)."""

    def __init__(self) -> None:
        super().__init__({}, schema("record", text="string"))
        self.seen: list[tuple[str, Any]] = []

    async def init_state(self, **create_kwargs: Any):
        self.seen.append(("create", create_kwargs))
        return {}

    async def execute(self, instance_id, parameters, **kwargs):
        self.seen.append(("execute", kwargs))
        return ToolResponse(text=parameters["text"]), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.seen.append(("calc_reward", kwargs))
        return 0.5

    async def release(self, instance_id, **kwargs):
        self.seen.append(("release", kwargs))
        await super().release(instance_id)


ROW_TOOLS_KWARGS = {"record": {"create_kwargs": {"seed": 1}, "execute_kwargs": {"mode": "fast"},
                               "calc_reward_kwargs": {"ground_truth": "7"}, "release_kwargs": {"keep": False}}}


async def test_every_tools_kwargs_part_reaches_its_stage(tokenizer):
    tool = RecordingTool()
    server = scripted(tokenizer, [call("record", text="a") + call("record", text="b"), "done"])
    out = await make_loop(server, tokenizer, [tool]).run(SAMPLING, raw_prompt=PROMPT, tools_kwargs=ROW_TOOLS_KWARGS)
    assert tool.seen == [("create", {"seed": 1}), ("execute", {"mode": "fast"}), ("execute", {"mode": "fast"}),
                         ("calc_reward", {"ground_truth": "7"}), ("release", {"keep": False})]
    assert tool_messages(out) == ["a", "b"]
    assert out.reward_score == 0.5
    assert tool.live_instances == 0


async def test_row_kwargs_a_tool_cannot_take_fail_the_sample_before_generating(tokenizer):
    # EchoTool.execute takes no **kwargs: the row's execute_kwargs must not be dropped, nor shown
    # to the model as a tool error; the sample fails (the worker records it) with the fix.
    server = scripted(tokenizer, [call("echo", text="a"), "done"])
    echo, counter = EchoTool(), CounterTool()
    loop = make_loop(server, tokenizer, [echo, counter])
    with pytest.raises(ToolKwargsError, match=r"tool 'echo'.*'execute_kwargs'.*add \*\*kwargs to execute"):
        await loop.run(SAMPLING, raw_prompt=PROMPT, tools_kwargs={"echo": {"execute_kwargs": {"mode": "x"}},
                                                                  "count": {"start": 3}})
    assert server.calls == []
    assert echo.live_instances == 0
    assert counter.live_instances == 0
    # Without row kwargs the same tool works.
    out = await loop.run(SAMPLING, raw_prompt=PROMPT, tools_kwargs={"echo": {"create_kwargs": {}}})
    assert tool_messages(out) == ["a"]


def test_loop_declares_its_config_class_and_unknown_keys_are_named():
    assert ToolAgentLoop.config_class is ToolAgentConfig
    check_loop_config_keys("tool_agent", ToolAgentLoop.config_class,
                           ["response_length", "max_parallel_calls", "tools", "tool_config_path",
                            "function_tool_path", "interaction", "interaction_config_path"])
    with pytest.raises(ValueError, match=r"tool_agent config has unknown keys 'max_assistant_turn' "
                                         r"\(did you mean 'max_assistant_turns'\?\), 'zzz'; valid keys: .*tool_parser"):
        check_loop_config_keys("tool_agent", ToolAgentConfig, ["max_assistant_turn", "zzz", "tool_parser"])
    with pytest.raises(TypeError, match="must be a dataclass"):
        check_loop_config_keys("x", dict, [])


def test_a_template_that_needs_tools_is_accepted_when_the_loop_has_them():
    """A tool_use template crashes without tools; the loop's check that the template renders
    tools must read that as "it does", not crash."""
    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_tools.agent_loop import ToolAgentLoop
    from agentloop_tools.builtin import calculator

    tok = load_tiny_tokenizer()
    needs_tools = ("{% for t in tools %}<|im_start|>system\ntool {{ t['function']['name'] }}<|im_end|>\n{% endfor %}"
                   "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    saved = tok.chat_template
    tok.chat_template = needs_tools
    try:
        loop = ToolAgentLoop(object(), tok, {"tools": {"calculator": calculator}})
        assert "tool calculator" in loop.renderer.render_text([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    finally:
        tok.chat_template = saved


class GateTool(BaseTool):
    """Waits for a gate every trajectory shares, so every call ends in one event-loop iteration."""

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__({}, schema("gate", text="string"))
        self.gate = gate
        self.waiting = 0

    async def execute(self, instance_id, parameters):
        self.waiting += 1
        await self.gate.wait()
        return ToolResponse(text="open"), 0.0, {}


@pytest.mark.parametrize("pace", [2, None])
async def test_tool_results_that_end_together_go_on_a_few_per_loop_iteration(tokenizer, pace):
    """The turn after a tool call (render, encode, the next generate) waits for the worker's
    turn slot, as the turn after a generate does: a burst of tool results never runs as one
    long event-loop iteration."""
    from agentloop_core.runtime import AgentLoopWorker

    iterations, next_turn_at = [0], []

    def tick() -> None:
        iterations[0] += 1
        if len(next_turn_at) < 12:
            asyncio.get_running_loop().call_soon(tick)

    def turns(request_id: str, prompt_ids: list[int], index: int) -> str:
        if index == 1:
            next_turn_at.append(iterations[0])
        return call("gate", text="x") if index == 0 else "#### 1"

    gate = asyncio.Event()
    tool = GateTool(gate)
    worker = AgentLoopWorker(scripted(tokenizer, turns), tokenizer, {
        "default_agent_loop": "tool_agent", "tools": {"gate": tool}, "response_length": 2048,
        "turns_per_loop_iteration": pace})
    batch = asyncio.create_task(worker.generate_sequences(
        [{"raw_prompt": PROMPT, "request_id": f"r{i}"} for i in range(12)]))
    for _ in range(1000):  # every trajectory starts (paced) and waits in the tool
        if tool.waiting == 12:
            break
        await asyncio.sleep(0)
    asyncio.get_running_loop().call_soon(tick)
    gate.set()
    outs = await asyncio.wait_for(batch, 60)
    assert not any(o.failed for o in outs)
    assert len(next_turn_at) == 12
    per_iteration = {it: next_turn_at.count(it) for it in next_turn_at}
    if pace is None:
        assert len(per_iteration) == 1, per_iteration
    else:
        assert max(per_iteration.values()) <= 2, per_iteration
        assert len(per_iteration) >= 6, per_iteration
