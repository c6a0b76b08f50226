"""OpenEnv environments under ``env_agent``: the environment registered as ``openenv``.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``openenv-core``) writes an environment as
``reset() -> Observation`` / ``step(Action) -> Observation`` with typed pydantic actions and
observations, served over HTTP/websocket for TRL, SkyRL and others. This adapter is an agentloop
:class:`~agentloop_core.environment.Environment`, so ``env_agent`` runs it with exact tokens: the
model's tokens are the engine's (mask 1), each observation is rendered as a message and appended
by the chat template's delta (mask 0); the adapter sees only decoded text and never re-encodes.

Config (``env_agent``)::

    environment: openenv
    environment_kwargs:
      env: my_pkg.envs:GuessEnv          # in process: an OpenEnv Environment class or factory
      # base_url: http://127.0.0.1:8000  # or served: an OpenEnv server (OpenEnv's client)
      env_kwargs: {max_tries: 3}         # the class's constructor arguments (in process)
      reset_kwargs: {seed: 7}            # reset(**reset_kwargs); a row may override them

The mapping:

- ``reset`` -> the first observation as a ``user`` message (the row's ``raw_prompt`` system
  messages stay before it; an observation with no text, as MCP environments reset, leaves the
  row's ``raw_prompt`` as the prompt).
- each assistant turn -> an Action: the ``action`` hook when given (``pkg.module:fn``,
  ``fn(turn, action_class) -> Action | dict``); else the turn's text (reasoning split off) in the
  action's one text field (``action_field`` picks it when there are several; when it cannot be
  told, the error names the action's fields and both fixes). MCP environments (action
  ``CallToolAction``): each parsed tool call becomes a ``CallToolAction`` and its result a
  ``tool`` message; their tools (``ListToolsAction`` at reset) are rendered into the prompt; a
  turn without calls ends the episode (or goes to the ``action`` hook, when given).
- the observation -> the next ``user`` message: ``render_observation`` (a hook, ``fn(fields) ->
  str``), else its ``observation_field``, else its only text field, else its fields as JSON.
- reward (None counts 0.0) and done from the observation; its ``metadata`` goes to
  ``extra_fields["step_infos"][i]["info"]["metadata"]`` (the reset's to the first step's
  ``reset_metadata``). An exception anywhere fails the sample (counted, never dropped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentloop_core.environment import (
    AssistantTurn,
    Environment,
    EnvironmentError,
    StepResult,
    register_environment,
)
from agentloop_core.imports import import_object
from agentloop_tools.openenv_session import LocalSession, Observed, RemoteSession, Session

__all__ = ["OpenEnvEnvironment", "text_action_field"]

ActionHook = Callable[[AssistantTurn, Any], Any]


@register_environment("openenv")
class OpenEnvEnvironment(Environment):
    """One OpenEnv episode, in process or served (see the module docstring).

    Args:
        env: In process: an OpenEnv ``Environment`` class, a factory, or its import path.
        base_url: Served: the OpenEnv server's URL (``http://host:port``). Exactly one of the two.
        env_kwargs: Constructor arguments of ``env``.
        reset_kwargs: Keyword arguments of ``reset`` (``seed``...); the row's ``request_id`` is
            passed as ``episode_id`` unless they set one.
        action: Hook building the action of a turn: ``fn(turn, action_class)`` returning an
            Action or its fields as a dict (``action_class`` is None when served without one).
        action_field: The action's field that receives the turn's text.
        action_class: The Action class (import path or class), when it cannot be read from the
            environment class; served, it types the actions (validated here before sending).
        observation_field: The observation's field rendered as the next message.
        render_observation: Hook ``fn(fields: dict) -> str`` rendering an observation.
        client: Served: an ``EnvClient`` subclass (default OpenEnv's ``GenericEnvClient``).
        mcp: Treat it as an MCP environment (tool calls -> ``CallToolAction``); None: when its
            action is ``CallToolAction``.
        connect_timeout_s: Served: seconds to open the websocket.
        message_timeout_s: Served: seconds to wait for one reply (``env_timeout_s`` bounds it too).

    Raises:
        ValueError: both or neither of ``env`` and ``base_url``, or a hook/class that does not import.
    """

    def __init__(self, env: Any = None, base_url: str | None = None, env_kwargs: Mapping[str, Any] | None = None,
                 reset_kwargs: Mapping[str, Any] | None = None, action: ActionHook | str | None = None,
                 action_field: str | None = None, action_class: Any = None, observation_field: str | None = None,
                 render_observation: Callable[[dict[str, Any]], str] | str | None = None, client: Any = None,
                 mcp: bool | None = None, connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0) -> None:
        if (env is None) == (base_url is None):
            raise ValueError("openenv: give exactly one of environment_kwargs.env (an OpenEnv Environment class, in "
                             "process) and environment_kwargs.base_url (an OpenEnv server URL)")
        if env is not None:
            self.session: Session = LocalSession(env, env_kwargs or {}, action_class)
        else:
            assert base_url is not None
            self.session = RemoteSession(base_url, client, action_class, connect_timeout_s, message_timeout_s)
        self.reset_kwargs = dict(reset_kwargs or {})
        self.action_hook: ActionHook | None = _hook(action, "action")
        self.render_hook = _hook(render_observation, "render_observation")
        self.action_field, self.observation_field, self.mcp = action_field, observation_field, mcp
        self._tools: list[dict[str, Any]] = []
        self._reset_metadata: dict[str, Any] | None = None

    async def reset(self, row: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        kwargs = dict(self.reset_kwargs)
        if row.get("request_id") is not None:
            kwargs.setdefault("episode_id", str(row["request_id"]))
        first = await self.session.reset(kwargs)
        if first.done:
            raise EnvironmentError(f"openenv {self._what()}: reset returned an observation with done=True; "
                                   "there is nothing for the model to act on")
        if self.mcp is None:
            self.mcp = _is_mcp(self.session.action_schema())
        if self.mcp:
            listed = await self.session.step({"type": "list_tools"})
            if "error" in listed.metadata:  # openenv's list_tools reports its failure only here
                raise EnvironmentError(f"openenv {self._what()}: list_tools failed: {listed.metadata['error']}")
            self._tools = [_openai_tool(t) for t in listed.fields.get("tools") or []]
        self._reset_metadata = first.metadata
        prompt = [dict(m) for m in row.get("raw_prompt") or []]
        text = self._render(first.fields) if first.fields else ""
        if not text:
            if not prompt:
                raise EnvironmentError(f"openenv {self._what()}: the reset observation has no text and the row no "
                                       "raw_prompt; give the row a prompt or set render_observation")
            return prompt
        return [*(m for m in prompt if m.get("role") == "system"), {"role": "user", "content": text}]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self._tools)

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.mcp and (turn.tool_calls or turn.tool_call_errors or self.action_hook is None):
            return await self._step_tools(turn)
        observed = await self.session.step(self._action(turn))
        messages = [] if observed.done else [{"role": "user", "content": self._render(observed.fields)}]
        return StepResult(messages, observed.reward or 0.0, observed.done, self._info([observed]))

    async def close(self) -> None:
        await self.session.close()

    async def _step_tools(self, turn: AssistantTurn) -> StepResult:
        """MCP: one ``CallToolAction`` per parsed call, answered by id; no call ends the episode."""
        if not turn.tool_calls and not turn.tool_call_errors:
            return StepResult([], 0.0, True, self._info([], ended="no_tool_call"))
        messages: list[dict[str, Any]] = []
        seen: list[Observed] = []
        for call, call_id in zip(turn.tool_calls, turn.tool_call_ids, strict=True):
            observed = await self.session.step({"type": "call_tool", "tool_name": call.name,
                                                "arguments": dict(call.arguments)})
            seen.append(observed)
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call_id,
                             "content": _tool_text(observed.fields)})
            if observed.done:  # the episode is over: the later calls of the turn are not run
                break
        messages += [{"role": "tool", "name": error.name or "", "tool_call_id": call_id, "content": f"Error: {error.reason}"}
                     for error, call_id in zip(turn.tool_call_errors, turn.error_call_ids, strict=True)]
        done = any(o.done for o in seen)
        return StepResult([] if done else messages, sum(o.reward or 0.0 for o in seen), done, self._info(seen))

    def _action(self, turn: AssistantTurn) -> Any:
        if self.action_hook is not None:
            built = self.action_hook(turn, self.session.action_class)
            if built is None:
                raise EnvironmentError(f"openenv {self._what()}: the action hook returned None; return an Action "
                                       "or its fields as a dict")
            return built
        schema = self.session.action_schema()
        return {text_action_field(schema, self.action_field): turn.content}

    def _render(self, fields: dict[str, Any]) -> str:
        if self.render_hook is not None:
            return str(self.render_hook(fields))
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise EnvironmentError(f"openenv {self._what()}: observation_field={self.observation_field!r} is not "
                                       f"a field of the observation; its fields: {sorted(fields)}")
            return _as_text(fields[self.observation_field])
        texts = [k for k, v in fields.items() if isinstance(v, str)]
        if len(fields) == 1 or len(texts) == 1:
            return _as_text(fields[texts[0] if len(texts) == 1 else next(iter(fields))])
        return json.dumps(fields, default=str, ensure_ascii=False)

    def _info(self, seen: Sequence[Observed], **extra: Any) -> dict[str, Any]:
        info: dict[str, Any] = dict(extra)
        metadata = [o.metadata for o in seen if o.metadata]
        if metadata:
            info["metadata"] = metadata[0] if len(metadata) == 1 else metadata
        if self._reset_metadata:
            info["reset_metadata"], self._reset_metadata = self._reset_metadata, None
        return info

    def _what(self) -> str:
        if isinstance(self.session, LocalSession):
            return type(self.session.env).__name__
        assert isinstance(self.session, RemoteSession)
        return self.session.base_url


def text_action_field(schema: Mapping[str, Any], chosen: str | None = None) -> str:
    """The field of an action JSON schema that takes the model's text: ``chosen`` when given,
    else the only string field (the only required one, when there are several).

    Raises:
        EnvironmentError: ``chosen`` is not a field, or no single text field can be told; the
            message names the action's fields and the two fixes.
    """
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    title = schema.get("title", "the action")
    fixes = ("set environment_kwargs.action_field=NAME, or environment_kwargs.action='pkg.module:fn' "
             "(fn(turn, action_class) -> Action or dict) to build the action yourself")
    if chosen is not None:
        if chosen not in properties:
            raise EnvironmentError(f"openenv: action_field={chosen!r} is not a field of {title}; its fields: "
                                   f"{_describe(properties)}")
        return chosen
    texts = [k for k, v in properties.items() if _is_text(v)]
    required = [k for k in texts if k in (schema.get("required") or [])]
    if len(texts) == 1:
        return texts[0]
    if len(required) == 1:
        return required[0]
    if not properties:
        fixes += "; or environment_kwargs.mcp=true if it is an MCP environment (tool calls as CallToolAction)"
    raise EnvironmentError(f"openenv: cannot tell which field of {title} takes the model's text; its fields: "
                           f"{_describe(properties)}; {fixes}")


def _is_text(prop: Mapping[str, Any]) -> bool:
    kinds = [prop.get("type"), *(p.get("type") for p in prop.get("anyOf") or [])]
    return "string" in kinds


def _describe(properties: Mapping[str, Any]) -> str:
    if not properties:
        return "(none)"
    return ", ".join(f"{k}: {v.get('type') or '|'.join(str(p.get('type')) for p in v.get('anyOf') or [])}"
                     for k, v in properties.items())


def _is_mcp(schema: Mapping[str, Any]) -> bool:
    props = schema.get("properties") or {}
    return {"tool_name", "arguments"} <= set(props) and schema.get("title") == "CallToolAction"


def _openai_tool(tool: Any) -> dict[str, Any]:
    data = tool.model_dump() if hasattr(tool, "model_dump") else dict(tool)
    parameters = data.get("input_schema") or data.get("inputSchema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": data["name"], "description": data.get("description") or "",
                                             "parameters": parameters}}


def _tool_text(fields: Mapping[str, Any]) -> str:
    """A ``CallToolObservation``'s result as text: the error, else the result's text parts."""
    error = fields.get("error")
    if error:
        message = error.get("message") if isinstance(error, Mapping) else getattr(error, "message", error)
        return f"Error: {message}"
    result = fields.get("result")  # a dumped CallToolResult: {"content": [{"type": "text", "text": ...}], ...}
    if isinstance(result, Mapping) and isinstance(result.get("content"), list):
        texts = [str(p.get("text")) for p in result["content"] if isinstance(p, Mapping) and p.get("text") is not None]
        if texts:
            return "\n".join(texts)
    return _as_text(result)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def _hook(value: Any, name: str) -> Any:
    if value is None or callable(value):
        return value
    hook = import_object(value, where=f"openenv {name}")
    if not callable(hook):
        raise ValueError(f"openenv {name}: {value!r} is not callable")
    return hook
