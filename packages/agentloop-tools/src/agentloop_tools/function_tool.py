"""``@function_tool``: turn a plain (sync or async) Python function into a :class:`BaseTool`.

The schema comes from the type hints and the Google-style docstring
(:func:`agentloop_tools.function_schema.schema_from_function`). Sync functions run in a small
thread pool of the tool's own (:class:`~agentloop_tools.sync_pool.SyncToolPool`, size
``config={"max_sync_threads": N}``, default 8), so a slow one does not stall the other
trajectories sharing the event loop, and one stuck past its timeout cannot take the threads of
the default executor that the engine and the rest of the process use. A sync function that
returns in microseconds and never blocks (bounded arithmetic, a lookup; no I/O) may run on the
event loop instead, ``config={"inline": True}``: no thread, no hand-over of the GIL (at 16384
trajectories in flight a pooled calculator call waited ~35 ms for its thread to get the GIL
from the busy loop); but nothing can interrupt it, so a slow one stalls every trajectory.

A dataset row's ``execute_kwargs`` reach the function as *hidden parameters*: parameters named
in ``@function_tool(hidden_params=[...])``, left out of the schema the model sees, and filled on
every call from the row (``tools_kwargs[name]["execute_kwargs"]``). The model cannot pass them.
Row keys that are not hidden parameters, and hidden parameters without a default that the row
does not give, raise :class:`~agentloop_tools.base.ToolKwargsError` at ``create``, which fails
the sample. ``calc_reward_kwargs``/``release_kwargs`` have no function to go to, so rows giving
them for a function tool fail the same way.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

from agentloop_tools.base import BaseTool, ToolKwargsError
from agentloop_tools.function_schema import schema_from_function
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse
from agentloop_tools.sync_pool import SyncToolPool

__all__ = ["DEFAULT_MAX_SYNC_THREADS", "FunctionTool", "function_tool", "normalize_tool_result"]

DEFAULT_MAX_SYNC_THREADS = 8
"""Threads of a sync function tool's own pool unless ``config={"max_sync_threads": N}`` says otherwise."""


def _inline_setting(value: Any, name: str, is_async: bool) -> bool:
    """The ``inline`` config value, checked."""
    if not isinstance(value, bool):
        raise ValueError(f"tool {name!r}: config inline must be true or false, got {value!r}")
    if value and is_async:
        raise ValueError(f"tool {name!r}: config inline is for sync functions (they run on the event loop "
                         "instead of a pool thread); an async function already runs on the loop: remove it")
    return value


def normalize_tool_result(result: Any, *, tool_name: str = "?") -> tuple[ToolResponse, float, dict[str, Any]]:
    """Turn whatever a function tool returned into ``(ToolResponse, reward, metrics)``.

    Accepted: ``str``; ``dict``/``list`` (JSON-encoded); numbers and bools (``str()``); None
    (empty text); :class:`ToolResponse`; a PIL image or a non-empty list of PIL images (an
    image response without text); ``(text, image)`` / ``(text, [images])``, a pair whose
    second item is a PIL image or a list of them; and tuples ``(response, reward)`` or
    ``(response, reward, metrics)`` where ``response`` is any of the former.

    Raises:
        TypeError: An unsupported return type, a non-numeric reward or non-dict metrics.
    """
    reward: float = 0.0
    metrics: dict[str, Any] = {}
    if _text_and_images(result):
        return _to_response(result, tool_name), reward, metrics
    if isinstance(result, tuple):
        if len(result) not in (2, 3):
            raise TypeError(
                f"function tool {tool_name!r} returned a tuple of {len(result)} items; return "
                "response, (response, reward) or (response, reward, metrics)"
            )
        result, raw_reward, *rest = result
        if isinstance(raw_reward, bool) or not isinstance(raw_reward, (int, float)) or math.isnan(raw_reward):
            raise TypeError(f"function tool {tool_name!r} returned reward {raw_reward!r}; it must be a number")
        reward = float(raw_reward)
        if rest:
            if not isinstance(rest[0], dict):
                raise TypeError(
                    f"function tool {tool_name!r} returned metrics of type {type(rest[0]).__name__}; "
                    "metrics must be a dict"
                )
            metrics = dict(rest[0])
    return _to_response(result, tool_name), reward, metrics


def _is_image(value: Any) -> bool:
    # PIL is not imported here: a value can only be a PIL image when PIL was imported already.
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(value, pil.Image)


def _images(value: Any) -> list[Any] | None:
    """``value`` as a list of PIL images when it is one or a non-empty list of them, else None."""
    if _is_image(value):
        return [value]
    if isinstance(value, list) and value and all(_is_image(v) for v in value):
        return list(value)
    return None


def _text_and_images(result: Any) -> bool:
    """Whether ``result`` is a ``(text, image(s))`` pair (not ``(response, reward)``)."""
    return isinstance(result, tuple) and len(result) == 2 and _images(result[1]) is not None


def _to_response(result: Any, tool_name: str) -> ToolResponse:
    if isinstance(result, ToolResponse):
        return result
    images = _images(result)
    if images is not None:
        return ToolResponse(image=images)
    if _text_and_images(result):
        text = result[0]
        if text is not None and not isinstance(text, str):
            raise TypeError(f"function tool {tool_name!r} returned ({type(text).__name__}, image); the first item "
                            "of a (text, image) pair must be a str or None")
        return ToolResponse(text=text, image=_images(result[1]))
    if isinstance(result, list) and any(_is_image(v) for v in result):
        raise TypeError(f"function tool {tool_name!r} returned a list mixing images with other values; return a list "
                        "of PIL images only, or (text, [images]), or ToolResponse(text=..., image=[...])")
    if isinstance(result, str):
        return ToolResponse(text=result)
    if result is None:
        return ToolResponse(text="")
    if isinstance(result, (bool, int, float)):
        return ToolResponse(text=str(result))
    if isinstance(result, (dict, list)):
        try:
            return ToolResponse(text=json.dumps(result, ensure_ascii=False))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"function tool {tool_name!r} returned a value that is not JSON-serialisable: {exc}") from exc
    raise TypeError(
        f"function tool {tool_name!r} returned {type(result).__name__}; return str, dict, list, a PIL image "
        "(or a list of them), (text, image), ToolResponse, or a tuple (response, reward[, metrics])"
    )


class FunctionTool(BaseTool):
    """A :class:`BaseTool` that calls a Python function with the model's arguments.

    The step reward is whatever the function returns as the second tuple item (0.0 otherwise);
    :meth:`calc_reward` returns the sum of an instance's step rewards.

    Args:
        fn: The function; sync functions run in the tool's own bounded thread pool.
        name: Tool name (default ``fn.__name__``).
        description: Overrides the docstring summary.
        schema: A full schema to use instead of inferring one.
        config: Tool config: ``timeout_s``, ``max_sync_threads`` (threads of the pool a sync
            function runs in; once all are stuck in calls past their timeout, new calls fail at
            once with :class:`~agentloop_tools.sync_pool.SyncToolPoolFullError`), and ``inline``
            (True: a sync function runs on the event loop, not in the pool; only for one that
            returns in microseconds and never blocks, since ``timeout_s`` cannot stop it).
        hidden_params: Parameters of ``fn`` filled from the row's ``execute_kwargs`` and hidden
            from the model (see the module docstring).

    Raises:
        TypeError: ``*args`` in the signature, or a hidden parameter that is not a named
            parameter of ``fn``.
        ValueError: An explicit ``schema`` shows a hidden parameter to the model, or ``inline``
            is not a bool or is set for an async function.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        hidden_params: Sequence[str] = (),
    ) -> None:
        if not callable(fn):
            raise TypeError(f"function_tool needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self._signature = inspect.signature(fn)
        # Callable objects with an `async def __call__` are async too.
        self._is_async = inspect.iscoroutinefunction(fn) or (
            not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
        )
        if isinstance(hidden_params, str):
            hidden_params = (hidden_params,)
        self.hidden_params: tuple[str, ...] = tuple(hidden_params)
        for pname in self.hidden_params:
            param = self._signature.parameters.get(pname)
            if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                raise TypeError(f"function tool {name or getattr(fn, '__name__', fn)!r}: hidden parameter {pname!r} is not a named "
                                f"parameter of the function (parameters: {list(self._signature.parameters)})")
        if schema is None:
            schema = _without(schema_from_function(fn, name=name, description=description), self.hidden_params)
        else:
            # Even with an explicit schema, reject *args/**kwargs: the model sends named arguments.
            for p in self._signature.parameters.values():
                if p.kind is inspect.Parameter.VAR_POSITIONAL:
                    raise TypeError(f"function tool {name or fn.__name__!r}: *{p.name} is not allowed")
        super().__init__(config, schema)
        shown = sorted(set(self.hidden_params) & set(self.tool_schema.function.parameters.properties))
        if shown:
            raise ValueError(f"function tool {self.name!r}: schema= shows hidden parameters {shown} to the model; "
                             "remove them from the schema's properties")
        if name is not None and name != self.name:
            # An explicit name wins over the schema's; copy so a shared schema object is not mutated.
            self.tool_schema = self.tool_schema.model_copy(deep=True)
            self.tool_schema.function.name = name
            self.name = name
        functools.update_wrapper(self, fn, updated=())
        self.max_sync_threads: int = self.config.get("max_sync_threads", DEFAULT_MAX_SYNC_THREADS)
        self.inline: bool = _inline_setting(self.config.get("inline", False), self.name, self._is_async)
        """A sync function called on the event loop (``config={"inline": True}``), not in the pool."""
        self._pool: SyncToolPool | None = None
        if self._uses_pool:
            self._pool = SyncToolPool(self.max_sync_threads, self.name)

    @property
    def _uses_pool(self) -> bool:
        return not self._is_async and not self.inline

    def __getstate__(self) -> dict[str, Any]:
        # Threads and locks do not pickle (Ray ships tools to workers); each copy makes its own pool.
        state = dict(self.__dict__)
        if state.get("_pool") is not None:
            state["_pool"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)  # the same dict; pyright types an ABC instance's __dict__ as a mappingproxy
        if self._uses_pool:
            self._pool = SyncToolPool(self.max_sync_threads, self.name)

    @property
    def sync_pool_stats(self) -> dict[str, int]:
        """A snapshot of the sync pool's ``threads``, ``started``, ``busy``, ``stuck`` and ``rejected`` counts
        (see :attr:`SyncToolPool.stats`); all zero for an async function."""
        if self._pool is None:
            return {"threads": 0, "started": 0, "busy": 0, "stuck": 0, "rejected": 0}
        return self._pool.stats

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly (handy in unit tests)."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTool(name={self.name!r}, fn={getattr(self.fn, '__qualname__', self.fn)!r})"

    async def init_state(self, **create_kwargs: Any) -> dict[str, Any]:
        return {"create_kwargs": dict(create_kwargs), "rewards": []}

    def check_lifecycle_kwargs(self, stage: str, kwargs: Mapping[str, Any]) -> None:
        """``execute_kwargs`` must name hidden parameters only, and give every hidden parameter
        that has no default; other stages take no kwargs.

        Raises:
            ToolKwargsError: naming the tool, the keys and the fix.
        """
        if stage != "execute":
            return super().check_lifecycle_kwargs(stage, kwargs)
        extra = sorted(set(kwargs) - set(self.hidden_params))
        if extra:
            raise ToolKwargsError(
                f"function tool {self.name!r}: the row's tools_kwargs[{self.name!r}]['execute_kwargs'] has keys "
                f"{extra} that are not hidden parameters (hidden: {list(self.hidden_params)}); add them as "
                f"parameters of the function and to @function_tool(hidden_params=[...]), or remove them "
                "from the dataset")
        missing = [p for p in self.hidden_params
                   if p not in kwargs and self._signature.parameters[p].default is inspect.Parameter.empty]
        if missing:
            raise ToolKwargsError(
                f"function tool {self.name!r}: hidden parameters {missing} have no default and the row's "
                f"tools_kwargs[{self.name!r}]['execute_kwargs'] does not give them; add them to the dataset "
                "or give them defaults")
        return None

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Call the function with ``parameters`` and the row's hidden parameters as keyword
        arguments.

        Args:
            instance_id: From :meth:`create`.
            parameters: The model's arguments.
            **kwargs: The row's ``execute_kwargs`` (hidden parameters only).

        Raises:
            TypeError: Arguments do not fit the signature (missing/unexpected, or the model
                named a hidden parameter), or the return value cannot be normalised.
            Exception: Whatever the function raises; the loop turns it into error text.
        """
        state = self.state(instance_id)
        if not isinstance(parameters, dict):
            raise TypeError(f"tool {self.name!r}: arguments must be a JSON object, got {type(parameters).__name__}")
        visible = [p for p in self._signature.parameters if p not in self.hidden_params]
        # The model does not see hidden parameters; passing one would override the row's value.
        named_hidden = sorted(set(parameters) & set(self.hidden_params))
        if named_hidden:
            raise TypeError(f"tool {self.name!r}: unexpected arguments {named_hidden}; expected {visible}")
        arguments = {**parameters, **kwargs}
        try:
            self._signature.bind(**arguments)
        except TypeError as exc:
            raise TypeError(
                f"tool {self.name!r}: bad arguments {sorted(parameters)}: {exc}; expected {visible}"
            ) from None
        stuck = 0
        if self._is_async:
            result = await self.fn(**arguments)
        else:
            if self.inline:
                result = self.fn(**arguments)
            else:
                assert self._pool is not None
                result = await self._pool.run(self.fn, **arguments)
            if inspect.isawaitable(result):
                result = await result
            if self._pool is not None:
                stuck = self._pool.stats["stuck"]
        response, reward, metrics = normalize_tool_result(result, tool_name=self.name)
        if stuck:
            # Threads of this tool still held by calls that timed out (summed per trajectory).
            metrics = {**metrics, "sync_pool_stuck_threads": stuck}
        state["rewards"].append(reward)
        return response, reward, metrics

    async def calc_reward(self, instance_id: str) -> float:
        return float(sum(self.state(instance_id)["rewards"]))


def _without(schema: OpenAIFunctionToolSchema, hidden: Sequence[str]) -> OpenAIFunctionToolSchema:
    """The schema minus the hidden parameters (they are filled from the row, not by the model)."""
    if not hidden:
        return schema
    data = schema.model_dump(exclude_none=True)
    params = data["function"]["parameters"]
    params["properties"] = {k: v for k, v in params.get("properties", {}).items() if k not in hidden}
    params["required"] = [k for k in params.get("required", []) if k not in hidden]
    return OpenAIFunctionToolSchema.model_validate(data)


@overload
def function_tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@overload
def function_tool(
    name: str | None = None,
    /,
    *,
    description: str | None = None,
    schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    hidden_params: Sequence[str] = (),
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(
    fn_or_name: Callable[..., Any] | str | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    hidden_params: Sequence[str] = (),
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Decorate a function to make it a tool: ``@function_tool``, ``@function_tool("name")`` or
    ``@function_tool(name=..., description=..., schema=..., config=..., hidden_params=[...])``.

    ``hidden_params`` name parameters filled from the dataset row's ``execute_kwargs`` and hidden
    from the model (see the module docstring).

    The result is a :class:`FunctionTool` (a :class:`BaseTool`) that is still callable like the
    original function.

    Raises:
        TypeError: ``*args``/``**kwargs`` in the signature or an unsupported type hint.
        ValueError: No docstring and no ``description=``.
    """
    if callable(fn_or_name):
        return FunctionTool(fn_or_name, name=name, description=description, schema=schema, config=config,
                            hidden_params=hidden_params)
    if fn_or_name is not None and not isinstance(fn_or_name, str):
        raise TypeError(f"@function_tool(...) takes a tool name string, got {type(fn_or_name).__name__}")
    if fn_or_name is not None and name is not None and fn_or_name != name:
        raise TypeError(f"@function_tool got two names: {fn_or_name!r} and name={name!r}")
    tool_name = fn_or_name or name

    def decorate(fn: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(fn, name=tool_name, description=description, schema=schema, config=config,
                            hidden_params=hidden_params)

    return decorate
