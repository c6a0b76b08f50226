"""The tool lifecycle every tool implements: create -> execute (many) -> calc_reward -> release.

One tool object serves every trajectory of a batch at once, so per-trajectory state lives in a
dict keyed by ``instance_id``; two trajectories never see each other's state.

A dataset row's ``tools_kwargs[tool_name]`` may use verl's nested form ``{"create_kwargs",
"execute_kwargs", "calc_reward_kwargs", "release_kwargs"}``. ``create_kwargs`` go to
:meth:`BaseTool.init_state`; the others reach ``execute(instance_id, parameters, **kwargs)``,
``calc_reward(instance_id, **kwargs)`` and ``release(instance_id, **kwargs)`` as keyword
arguments when the loops call :meth:`BaseTool.run_execute`, :meth:`BaseTool.run_calc_reward` and
:meth:`BaseTool.run_release`. They are passed only when the row has some, so a tool whose
methods take no ``**kwargs`` keeps working on rows without them. When a row has kwargs that a
method cannot take, :meth:`BaseTool.create` raises :class:`ToolKwargsError` before any state
exists, and the loops fail the sample with it: a misconfigured dataset is not something the
model should read about, nor should the kwargs be dropped silently. The default
``calc_reward``/``release`` take no kwargs on purpose, so row kwargs for a tool that never reads
them are an error too.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "LIFECYCLE_KWARGS_KEYS",
    "LIFECYCLE_STAGES",
    "BaseTool",
    "ToolKwargsError",
    "create_instances",
    "normalize_tools_kwargs",
]

LIFECYCLE_KWARGS_KEYS: tuple[str, ...] = (
    "create_kwargs",
    "execute_kwargs",
    "calc_reward_kwargs",
    "release_kwargs",
)
"""Keys of the verl-style nested form of a dataset row's ``tools_kwargs[tool_name]``."""

LIFECYCLE_STAGES: tuple[str, ...] = ("execute", "calc_reward", "release")
"""The methods that receive the row's ``<stage>_kwargs`` as keyword arguments."""


class ToolKwargsError(TypeError):
    """A dataset row's ``tools_kwargs`` do not fit the tool: a method cannot take its
    ``execute_kwargs`` / ``calc_reward_kwargs`` / ``release_kwargs``. The loops fail the sample
    with it instead of showing it to the model."""


def normalize_tools_kwargs(
    tools_kwargs: Mapping[str, Any] | None, *, tool_name: str = "?"
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Split a row's per-tool kwargs into create kwargs and the other lifecycle kwargs.

    Accepts both the verl-style nested form ``{"create_kwargs": {...}, "execute_kwargs": {...}}``
    and a flat dict (all of it is create kwargs).

    Args:
        tools_kwargs: ``extra_info.tools_kwargs[tool_name]`` from the dataset row, or None.
        tool_name: Used in error messages only.

    Returns:
        ``(create_kwargs, {"execute_kwargs": ..., "calc_reward_kwargs": ..., "release_kwargs": ...})``.

    Raises:
        ValueError: The nested form is mixed with flat keys, or a nested value is not a dict.
    """
    kwargs = dict(tools_kwargs or {})
    nested = [k for k in kwargs if k in LIFECYCLE_KWARGS_KEYS]
    if not nested:
        return kwargs, {}
    flat = [k for k in kwargs if k not in LIFECYCLE_KWARGS_KEYS]
    if flat:
        raise ValueError(
            f"tools_kwargs for tool {tool_name!r} mixes the nested form ({nested}) with flat keys "
            f"({flat}); put the flat keys inside 'create_kwargs'"
        )
    for key in nested:
        if kwargs[key] is not None and not isinstance(kwargs[key], Mapping):
            raise ValueError(
                f"tools_kwargs[{tool_name!r}][{key!r}] must be a dict, got {type(kwargs[key]).__name__}"
            )
    create = dict(kwargs.pop("create_kwargs", None) or {})
    return create, {k: dict(v or {}) for k, v in kwargs.items()}


class BaseTool(abc.ABC):
    """A tool the model can call. Subclass it, implement :meth:`execute`, and optionally
    :meth:`init_state` (per-trajectory set-up from the dataset row) and :meth:`calc_reward`.

    Args:
        config: Tool configuration (from the YAML ``config:`` block). ``timeout_s`` is read
            here; the loop uses it to bound each ``execute``.
        tool_schema: The OpenAI function schema (model or plain dict). None uses
            :meth:`default_tool_schema`, which subclasses with a fixed schema override.

    Raises:
        ValueError: The schema is missing or invalid, or ``timeout_s`` is not a positive number.
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
    ) -> None:
        self.config: dict[str, Any] = dict(config or {})
        if tool_schema is None:
            tool_schema = self.default_tool_schema()
        if tool_schema is None:
            raise ValueError(
                f"{type(self).__name__} needs a tool_schema: pass one (OpenAIFunctionToolSchema or "
                "dict) or override default_tool_schema()"
            )
        if not isinstance(tool_schema, OpenAIFunctionToolSchema):
            try:
                tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
            except ValidationError as exc:
                raise ValueError(f"invalid tool_schema for {type(self).__name__}: {exc}") from exc
        self.tool_schema: OpenAIFunctionToolSchema = tool_schema
        self.name: str = tool_schema.function.name
        timeout = self.config.get("timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ValueError(f"tool {self.name!r}: config timeout_s must be a positive number, got {timeout!r}")
        self.timeout_s: float | None = None if timeout is None else float(timeout)
        self._instances: dict[str, dict[str, Any]] = {}
        self._lifecycle_kwargs: dict[str, dict[str, dict[str, Any]]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, live_instances={len(self._instances)})"

    def default_tool_schema(self) -> OpenAIFunctionToolSchema | dict[str, Any] | None:
        """Schema used when none is passed; None means a schema is required."""
        return None

    async def init_state(self, **create_kwargs: Any) -> dict[str, Any]:
        """Build the per-trajectory state from the row's create kwargs.

        Args:
            **create_kwargs: ``tools_kwargs[tool_name]["create_kwargs"]`` (or the flat dict).

        Returns:
            The state dict, later available as ``self.state(instance_id)``.
        """
        return dict(create_kwargs)

    async def create(self, instance_id: str | None = None, **tools_kwargs: Any) -> str:
        """Start one trajectory's use of this tool.

        Args:
            instance_id: Id to use; None makes a fresh unique one.
            **tools_kwargs: The row's ``tools_kwargs[tool_name]``, nested verl-style
                (``create_kwargs=..., execute_kwargs=...``) or flat.

        Returns:
            The instance id to pass to execute/calc_reward/release.

        Raises:
            ValueError: The id is already live, or tools_kwargs is malformed.
            ToolKwargsError: A method cannot take the row's kwargs for its stage (see
                :meth:`check_lifecycle_kwargs`).
        """
        iid = instance_id if instance_id is not None else f"{self.name}-{uuid.uuid4().hex}"
        if iid in self._instances:
            raise ValueError(
                f"tool {self.name!r}: instance {iid!r} already exists; release it first or pass "
                "instance_id=None for a fresh one"
            )
        create_kwargs, lifecycle = normalize_tools_kwargs(tools_kwargs, tool_name=self.name)
        for stage in LIFECYCLE_STAGES:
            self.check_lifecycle_kwargs(stage, lifecycle.get(f"{stage}_kwargs", {}))
        state = await self.init_state(**create_kwargs)
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__}.init_state must return a dict, got {type(state).__name__}")
        self._instances[iid] = state
        self._lifecycle_kwargs[iid] = lifecycle
        return iid

    def state(self, instance_id: str) -> dict[str, Any]:
        """The mutable state of one live instance.

        Raises:
            KeyError: The id was never created or was already released.
        """
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(
                f"tool {self.name!r} has no live instance {instance_id!r}: call create() first "
                "(or it was already released)"
            ) from None

    def lifecycle_kwargs(self, instance_id: str, stage: str) -> dict[str, Any]:
        """The row's ``execute_kwargs`` / ``calc_reward_kwargs`` / ``release_kwargs`` for an instance.

        Args:
            instance_id: A live instance.
            stage: ``"execute"``, ``"calc_reward"`` or ``"release"``.
        """
        self.state(instance_id)
        return self._stage_kwargs(instance_id, stage)

    def _stage_kwargs(self, instance_id: str, stage: str) -> dict[str, Any]:
        return dict(self._lifecycle_kwargs.get(instance_id, {}).get(f"{stage}_kwargs") or {})

    def check_lifecycle_kwargs(self, stage: str, kwargs: Mapping[str, Any]) -> None:
        """Check that a stage's method can take the row's kwargs for it. :meth:`create` calls it
        for every stage (with ``{}`` when the row has none) before any state exists; override it
        to check more (``FunctionTool`` checks its hidden parameters).

        Args:
            stage: ``"execute"``, ``"calc_reward"`` or ``"release"``.
            kwargs: The row's ``<stage>_kwargs``.

        Raises:
            ToolKwargsError: The method's signature cannot bind them; the message names the tool,
                the stage, the keys and the fix.
        """
        if not kwargs:
            return
        method = getattr(self, stage)
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):  # no introspectable signature: let the call decide
            return
        positional = ("instance_id", {}) if stage == "execute" else ("instance_id",)
        try:
            signature.bind(*positional, **kwargs)
        except TypeError as exc:
            raise ToolKwargsError(
                f"tool {self.name!r}: the row's tools_kwargs[{self.name!r}][{stage + '_kwargs'!r}] has keys "
                f"{sorted(kwargs)}, but {type(self).__name__}.{stage}{signature} cannot take them ({exc}); "
                f"add **kwargs to {stage} (verl-style) or name them as parameters, or remove "
                f"{stage}_kwargs from the dataset"
            ) from None

    async def run_execute(
        self, instance_id: str, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """What a loop calls for one tool call: :meth:`execute` with the row's ``execute_kwargs``
        as keyword arguments, when the row has any.

        Args:
            instance_id: From :meth:`create`.
            parameters: Arguments the model passed.
        """
        return await self.execute(instance_id, parameters, **self._stage_kwargs(instance_id, "execute"))

    async def run_calc_reward(self, instance_id: str) -> float:
        """What a loop calls for the reward: :meth:`calc_reward` with the row's
        ``calc_reward_kwargs``, when the row has any."""
        return await self.calc_reward(instance_id, **self._stage_kwargs(instance_id, "calc_reward"))

    async def run_release(self, instance_id: str) -> None:
        """What a loop calls at the end of a trajectory: :meth:`release` with the row's
        ``release_kwargs``, when the row has any."""
        await self.release(instance_id, **self._stage_kwargs(instance_id, "release"))

    @property
    def live_instances(self) -> int:
        """How many instances are created and not yet released."""
        return len(self._instances)

    @abc.abstractmethod
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one tool call. An implementation that reads no ``execute_kwargs`` may leave out
        ``**kwargs``; rows that give some are then an error, not silently ignored.

        Args:
            instance_id: From :meth:`create`.
            parameters: Arguments the model passed (already checked against the schema by the loop).
            **kwargs: The row's ``execute_kwargs``, passed only when it has some.

        Returns:
            ``(response, step_reward, metrics)``.
        """

    async def calc_reward(self, instance_id: str) -> float:
        """The tool's reward for the trajectory so far (default 0.0).

        Override it as ``calc_reward(self, instance_id, **kwargs)`` to receive the row's
        ``calc_reward_kwargs``; this default takes none, so rows that give some are an error.

        Args:
            instance_id: From :meth:`create`.
        """
        self.state(instance_id)
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Drop the instance's state. Releasing an unknown id is a no-op, so a loop can release
        in a ``finally`` block after a failed create.

        Override it as ``release(self, instance_id, **kwargs)`` (and call ``super().release``) to
        receive the row's ``release_kwargs``; this default takes none.

        Args:
            instance_id: From :meth:`create`.
        """
        self._instances.pop(instance_id, None)
        self._lifecycle_kwargs.pop(instance_id, None)


async def create_instances(tools: Mapping[str, BaseTool], tools_kwargs: Mapping[str, Any]) -> dict[str, str | Exception]:
    """Create one trajectory's instance of every tool, concurrently.

    Args:
        tools: The loop's tools by name.
        tools_kwargs: The row's ``tools_kwargs`` (by tool name; tools it does not name get none).

    Returns:
        By tool name, the instance id or the exception its ``create`` raised. Every create has
        finished, so a loop that fails the sample on a :class:`ToolKwargsError` can first
        release every instance that exists.
    """
    async def create(name: str, tool: BaseTool) -> str | Exception:
        try:
            return await tool.create(None, **dict(tools_kwargs.get(name) or {}))
        except Exception as exc:  # noqa: BLE001 - the loop decides: unavailable tool or failed sample
            return exc

    results = await asyncio.gather(*(create(name, tool) for name, tool in tools.items()))
    return dict(zip(tools, results, strict=True))
