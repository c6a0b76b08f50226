"""How the ``openenv`` environment reaches one OpenEnv environment: in this process (an
``openenv`` :class:`~openenv.core.env_server.interfaces.Environment` built per trajectory) or
served (an OpenEnv server URL, through OpenEnv's own websocket client).

Both hand back the same :class:`Observed` record, so the adapter maps turns and observations
once. The served path reads the action's JSON schema from the server's ``/schema`` (what an
OpenEnv server publishes for clients that do not install the environment's package); OpenEnv's
wire format drops an observation's ``metadata`` (``serialize_observation``), so a served
environment's metadata does not reach the trajectory.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import json
import typing
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.imports import import_object

try:
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.interfaces import Environment as OpenEnvBase
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
    from openenv.core.env_server.types import Action
    from openenv.core.generic_client import GenericEnvClient
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('the openenv environment needs openenv-core: pip install "agentloop-tools[openenv]"') from exc

__all__ = ["LocalSession", "Observed", "RemoteSession", "Session", "action_class_of"]

_NOT_FIELDS = frozenset({"done", "reward", "metadata"})
_MCP_ACTIONS: dict[Any, type[Action]] = {"list_tools": ListToolsAction, "call_tool": CallToolAction}


@dataclass(frozen=True)
class Observed:
    """One OpenEnv observation, in or out of process alike."""

    fields: dict[str, Any]
    """The observation's own fields (``done``, ``reward`` and ``metadata`` taken out)."""
    reward: float | None
    """Its reward (None when the environment set none)."""
    done: bool
    """The episode is over."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Its ``metadata`` (empty for a served environment: OpenEnv's wire format drops it)."""


def _observed(observation: Any, reward: Any = None, done: Any = None) -> Observed:
    """An observation object (pydantic) or a served payload (dict) as an :class:`Observed`."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation or {})
    reward = data.get("reward") if reward is None else reward
    done = data.get("done", False) if done is None else done
    fields = {k: v for k, v in data.items() if k not in _NOT_FIELDS}
    return Observed(fields, None if reward is None else float(reward), bool(done), dict(data.get("metadata") or {}))


def action_class_of(env_class: type) -> type[Action] | None:
    """The Action class an OpenEnv environment class declares: the first type argument of its
    ``Environment[Act, Obs, State]`` base, else the annotation of ``step``'s ``action``; None
    when it declares neither (or only the ``Action`` base)."""
    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if (typing.get_origin(base) is not None and args and isinstance(args[0], type)
                    and issubclass(args[0], Action) and args[0] is not Action):
                return args[0]
    with contextlib.suppress(Exception):  # unresolvable annotations: fall through to "declares none"
        hint = typing.get_type_hints(env_class.step).get("action")
        if isinstance(hint, type) and issubclass(hint, Action) and hint is not Action:
            return hint
    return None


class Session(abc.ABC):
    """One episode's connection to an OpenEnv environment."""

    action_class: type[Action] | None
    """The Action class (in process always; served only when the config names it)."""

    @abc.abstractmethod
    async def reset(self, kwargs: Mapping[str, Any]) -> Observed:
        """Reset the environment with ``kwargs`` (``seed``, ``episode_id``, the env's own)."""

    @abc.abstractmethod
    async def step(self, action: Action | Mapping[str, Any]) -> Observed:
        """Step with an action (an Action object, or its fields as a dict)."""

    @abc.abstractmethod
    def action_schema(self) -> dict[str, Any]:
        """The action's JSON schema (known after :meth:`reset`)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the environment or the connection."""

    def validate(self, action: Action | Mapping[str, Any]) -> Action | dict[str, Any]:
        """The action as this session sends it: an ``action_class`` object when the class is
        known (pydantic names a bad field here, before the step), else the dict."""
        if isinstance(action, Action):
            return action
        mcp = _MCP_ACTIONS.get(action.get("type"))
        if mcp is not None:
            # Routed by "type", as OpenEnv's deserialize_action routes them: an MCP environment takes
            # them through step whatever Action class it declares. Served, the server validates.
            return mcp.model_validate(dict(action)) if isinstance(self, LocalSession) else dict(action)
        if self.action_class is not None:
            return self.action_class.model_validate(dict(action))
        return dict(action)


class LocalSession(Session):
    """An OpenEnv environment object in this process. Sync ``reset``/``step``/``close`` run on
    one worker thread of its own (as OpenEnv's server runs them), so a slow step neither blocks
    the event loop nor escapes ``env_timeout_s``; an overridden ``reset_async``/``step_async``
    is awaited as it is. An ``mcp_session()`` the environment offers (MCP environments) is held
    open for the episode, as OpenEnv's server holds it for a websocket session."""

    def __init__(self, env: Any, env_kwargs: Mapping[str, Any], action_class: Any = None) -> None:
        factory = import_object(env, where="openenv env") if isinstance(env, str) else env
        if isinstance(factory, OpenEnvBase):
            raise ValueError(f"openenv env: got the instance {factory!r:.100}; pass its class (or a factory "
                             "function): the loop builds one environment per trajectory")
        if not callable(factory):
            raise ValueError(f"openenv env: {env!r:.100} is not an OpenEnv Environment class or factory")
        self.env: Any = factory(**dict(env_kwargs))
        if not isinstance(self.env, OpenEnvBase):
            raise ValueError(f"openenv env: {env!r:.100} built a {type(self.env).__name__}, not an "
                             "openenv.core.env_server.interfaces.Environment")
        cls = import_object(action_class, where="openenv action_class") if isinstance(action_class, str) else action_class
        self.action_class = cls or action_class_of(type(self.env)) or _mcp_default(self.env)
        if self.action_class is None:
            raise ValueError(f"openenv: cannot tell the Action class of {type(self.env).__name__} (neither "
                             "Environment[MyAction, ...] nor an annotated step(action: MyAction)); set "
                             "environment_kwargs.action_class='pkg.module:MyAction'")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openenv")
        self._stack = contextlib.AsyncExitStack()

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def reset(self, kwargs: Mapping[str, Any]) -> Observed:
        session = getattr(self.env, "mcp_session", None)
        if callable(session):
            await self._stack.enter_async_context(typing.cast(Any, session()))
        if _overrides(self.env, "reset_async"):
            fn = self.env.reset_async
            return _observed(await fn(**_accepted(fn, kwargs)))
        return _observed(await self._run(self.env.reset, **_accepted(self.env.reset, kwargs)))

    async def step(self, action: Action | Mapping[str, Any]) -> Observed:
        typed = self.validate(action)
        if _overrides(self.env, "step_async"):
            return _observed(await self.env.step_async(typed))
        return _observed(await self._run(self.env.step, typed))

    def action_schema(self) -> dict[str, Any]:
        assert self.action_class is not None
        return self.action_class.model_json_schema()

    async def close(self) -> None:
        try:
            await self._stack.aclose()
            await self._run(self.env.close)
        finally:
            self._thread.shutdown(wait=False)


class RemoteSession(Session):
    """An OpenEnv server, through OpenEnv's own client: :class:`GenericEnvClient` (dicts, no
    environment package needed here) unless the config names a typed ``EnvClient`` subclass.
    One websocket session per trajectory: the server must allow as many concurrent sessions
    (``max_concurrent_envs``) as trajectories run at once, or the extra ones fail (counted)."""

    def __init__(self, base_url: str, client: Any = None, action_class: Any = None,
                 connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0) -> None:
        cls = import_object(client, where="openenv client") if isinstance(client, str) else (client or GenericEnvClient)
        if not (isinstance(cls, type) and issubclass(cls, EnvClient)):
            raise ValueError(f"openenv client: {client!r:.100} is not an openenv.core.env_client.EnvClient subclass")
        self.base_url = base_url.rstrip("/")
        self.client: Any = cls(base_url=self.base_url, connect_timeout_s=connect_timeout_s,
                               message_timeout_s=message_timeout_s)
        self.action_class = (import_object(action_class, where="openenv action_class")
                             if isinstance(action_class, str) else action_class)
        self._timeout = connect_timeout_s
        self._schema: dict[str, Any] | None = None

    async def reset(self, kwargs: Mapping[str, Any]) -> Observed:
        if self.action_class is not None:
            self._schema = self.action_class.model_json_schema()
        else:
            self._schema = await asyncio.to_thread(self._fetch_schema)
        result = await self.client.reset(**dict(kwargs))
        return _observed(result.observation, result.reward, result.done)

    async def step(self, action: Action | Mapping[str, Any]) -> Observed:
        result = await self.client.step(self.validate(action))
        return _observed(result.observation, result.reward, result.done)

    def action_schema(self) -> dict[str, Any]:
        assert self._schema is not None, "reset() reads the schema"
        return self._schema

    def _fetch_schema(self) -> dict[str, Any]:
        url = f"{self.base_url}/schema"
        try:
            with urllib.request.urlopen(url, timeout=self._timeout) as response:  # noqa: S310 - the configured server
                return dict(json.load(response)["action"])
        except Exception as exc:
            raise ConnectionError(f"openenv: cannot read the action schema from {url} ({type(exc).__name__}: {exc}); "
                                  "is an OpenEnv server running there? (or set environment_kwargs.action_class)") from exc

    async def close(self) -> None:
        await self.client.close()


def _mcp_default(env: Any) -> type[Action] | None:
    # MCP environments (MCPEnvironment) take CallToolAction through step without declaring it.
    return CallToolAction if callable(getattr(env, "mcp_session", None)) else None


def _overrides(env: Any, method: str) -> bool:
    return getattr(type(env), method) is not getattr(OpenEnvBase, method)


def _accepted(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (all when it takes ``**kwargs``), as OpenEnv's server
    filters reset's (``_get_valid_kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}
