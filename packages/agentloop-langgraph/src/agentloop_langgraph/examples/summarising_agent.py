"""A ReAct agent that summarises its own context: a graph whose trajectories have segments.

Long-horizon agents keep their context short by replacing earlier turns with a summary. The
model's later calls then no longer extend its earlier ones, so no single token sequence holds
the episode; the ``react_agent`` loop returns one segment per context instead (see its
``on_history_rewrite``), each a training row of tokens the engine generated in that context.

The graph: ``agent`` (one model call), then ``tools`` (the calls it made) or, when it made
none, ``nudge`` (a user message, if configured) or the end; ``summarise`` runs before every
later model call and, once the context holds ``summarise_after`` model turns, replaces all but
the last ``keep_last_turns`` of them (with their tool results) by one user message listing what
they did. The summary is written by code, not by the model, so no summarising call is trained.

In a rollout config::

    graph_factory: agentloop_langgraph.examples.summarising_agent:summarising_agent
    graph_factory_kwargs: {summarise_after: 2, keep_last_turns: 1}

A model turn takes three LangGraph steps (agent, tools or nudge, summarise): keep
``recursion_limit`` above three times the turns you allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.prebuilt import ToolNode

from agentloop_langgraph.messages import content_text

SUMMARY_NAME = "context_summary"
"""``name`` of the user message that holds the summary (a later summary carries its lines on)."""

_SUMMARY_HEADER = "Summary of your earlier turns (removed to keep the context short):"


def summarising_agent(
    chat_model: Any,
    tools: Sequence[Any],
    *,
    system_prompt: str | None = None,
    summarise_after: int = 2,
    keep_last_turns: int = 1,
    nudge: str | None = None,
    max_item_chars: int = 200,
) -> Any:
    """A ReAct agent over ``tools`` that replaces its earlier turns by a summary.

    Args:
        chat_model: The :class:`~agentloop_langgraph.ChatModel` (tools are bound here).
        tools: LangChain tools.
        system_prompt: Prepended as a system message on every model call.
        summarise_after: Model turns the context may hold before the earlier ones are
            summarised (checked before each model call).
        keep_last_turns: Most recent model turns kept verbatim, each with the messages after
            it (tool results, nudges); fewer than ``summarise_after``.
        nudge: User message sent when the model answers without calling a tool, so the
            episode goes on until ``max_assistant_turns`` or ``recursion_limit``; None: such
            an answer ends the episode.
        max_item_chars: Longest text (a tool result, an answer) quoted in the summary.

    Returns:
        The compiled graph, taking ``{"messages": [...]}``.

    Raises:
        ValueError: a bad ``summarise_after``, ``keep_last_turns`` or ``max_item_chars``.
    """
    for key, value, low in (("summarise_after", summarise_after, 1), ("keep_last_turns", keep_last_turns, 0),
                            ("max_item_chars", max_item_chars, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"summarising_agent {key} must be an integer >= {low}, got {value!r}")
    if keep_last_turns >= summarise_after:
        raise ValueError(f"summarising_agent keep_last_turns={keep_last_turns} must be below "
                         f"summarise_after={summarise_after}, or nothing is ever summarised")
    model = chat_model.bind_tools(list(tools))

    async def agent(state: MessagesState) -> dict[str, Any]:
        view = list(state["messages"])
        if system_prompt is not None:
            view = [SystemMessage(system_prompt), *view]
        return {"messages": [await model.ainvoke(view)]}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]  # the agent node's reply: an AIMessage
        if isinstance(last, AIMessage) and last.tool_calls:
            return "tools"
        return "nudge" if nudge is not None else END

    def ask_again(state: MessagesState) -> dict[str, Any]:
        return {"messages": [HumanMessage(nudge)]}

    def summarise(state: MessagesState) -> dict[str, Any]:
        messages = state["messages"]
        turns = [i for i, m in enumerate(messages) if isinstance(m, AIMessage)]
        if len(turns) < summarise_after:
            return {}
        cut = turns[-keep_last_turns] if keep_last_turns else len(messages)
        head = messages[: turns[0]]
        task = [m for m in head if not is_summary(m)]
        summary = summary_message([*[m for m in head if is_summary(m)], *messages[turns[0] : cut]], max_item_chars)
        # REMOVE_ALL_MESSAGES, then the new context: add_messages replaces the whole list.
        return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *task, summary, *messages[cut:]]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(list(tools)))
    graph.add_node("summarise", summarise)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END] if nudge is None else ["tools", "nudge"])
    graph.add_edge("tools", "summarise")
    if nudge is not None:
        graph.add_node("nudge", ask_again)
        graph.add_edge("nudge", "summarise")
    graph.add_edge("summarise", "agent")
    return graph.compile()


def is_summary(message: BaseMessage) -> bool:
    """Whether ``message`` is a summary this graph wrote."""
    return isinstance(message, HumanMessage) and message.name == SUMMARY_NAME


def summary_message(messages: Sequence[BaseMessage], max_item_chars: int = 200) -> HumanMessage:
    """One user message listing what ``messages`` did: each tool call with its result, each
    answer without a call, each user message; an earlier summary's lines come first."""
    results = {m.tool_call_id: content_text(m) for m in messages if isinstance(m, ToolMessage)}
    answered = set()
    lines: list[str] = []
    for m in messages:
        if is_summary(m):
            lines += [line for line in content_text(m).splitlines() if line.startswith("- ")]
        elif isinstance(m, AIMessage):
            for call in m.tool_calls:
                args = ", ".join(f"{k}={v!r}" for k, v in call["args"].items())
                result = results.get(call["id"] or "")
                answered.add(call["id"])
                lines.append(f"- you called {call['name']}({args}): "
                             + ("no result" if result is None else _short(result, max_item_chars)))
            if not m.tool_calls:
                lines.append(f"- you answered: {_short(content_text(m), max_item_chars)}")
        elif isinstance(m, ToolMessage) and m.tool_call_id not in answered:
            lines.append(f"- tool {m.name or '?'} said: {_short(content_text(m), max_item_chars)}")
        elif isinstance(m, HumanMessage):
            lines.append(f"- the user said: {_short(content_text(m), max_item_chars)}")
    return HumanMessage("\n".join([_SUMMARY_HEADER, *lines]), name=SUMMARY_NAME)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["SUMMARY_NAME", "is_summary", "summarising_agent", "summary_message"]
