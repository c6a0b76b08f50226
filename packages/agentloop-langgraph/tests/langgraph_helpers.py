"""Plain helpers shared by the tests (imported by module name; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json

from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode


def hermes_call(name: str, **arguments) -> str:
    """The text of one hermes tool call, as a Qwen2.5-style model writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def generated(server) -> list[int]:
    """Every id a ScriptedServer returned, in call order."""
    return [t for call in server.calls for t in call.output.token_ids]


def masked(out, mask_value: int = 1) -> list[int]:
    """The response ids whose mask equals ``mask_value``."""
    return [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == mask_value]


def trimming_graph(chat_model, tools):
    """A ReAct-style graph that shows the model only the first and the last message: the kind of
    history trimming that makes a trajectory untrainable without re-encoding."""
    model = chat_model.bind_tools(tools)

    async def agent(state: MessagesState):
        messages = state["messages"]
        view = messages if len(messages) <= 2 else [messages[0], messages[-1]]
        return {"messages": [await model.ainvoke(view)]}

    def route(state: MessagesState):
        return "tools" if state["messages"][-1].tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


def ask_again_graph(chat_model, tools, turns: int = 3):
    """Model turn, then a user nudge, ``turns`` times: several real engine turns from a model that
    never calls tools on purpose (random weights)."""
    from langchain_core.messages import HumanMessage

    model = chat_model.bind_tools(tools)

    async def agent(state: MessagesState):
        return {"messages": [await model.ainvoke(state["messages"])]}

    def nudge(state: MessagesState):
        return {"messages": [HumanMessage("Please use the calculator and answer again.")]}

    def route(state: MessagesState):
        done = sum(m.type == "ai" for m in state["messages"]) >= turns
        return END if done else ("tools" if state["messages"][-1].tool_calls else "nudge")

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_node("nudge", nudge)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", "nudge", END])
    graph.add_edge("tools", "agent")
    graph.add_edge("nudge", "agent")
    return graph.compile()
