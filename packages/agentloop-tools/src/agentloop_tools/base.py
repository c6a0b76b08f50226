"""The tool lifecycle every tool implements: create -> execute (many) -> calc_reward -> release.

One tool object serves every trajectory of a batch at once, so per-trajectory state lives in a
dict keyed by ``instance_id``; two trajectories never see each other's state.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["LIFECYCLE_KWARGS_KEYS", "BaseTool", "normalize_tools_kwargs"]

LIFECYCLE_KWARGS_KEYS: tuple[str, ...] = (
    "create_kwargs",
    "execute_kwargs",
    "calc_reward_kwargs",
    "release_kwargs",
)
"""Keys of the verl-style nested form of a dataset row's ``tools_kwargs[tool_name]``."""


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
        """
        iid = instance_id if instance_id is not None else f"{self.name}-{uuid.uuid4().hex}"
        if iid in self._instances:
            raise ValueError(
                f"tool {self.name!r}: instance {iid!r} already exists; release it first or pass "
                "instance_id=None for a fresh one"
            )
        create_kwargs, lifecycle = normalize_tools_kwargs(tools_kwargs, tool_name=self.name)
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
        return dict(self._lifecycle_kwargs.get(instance_id, {}).get(f"{stage}_kwargs", {}))

    @property
    def live_instances(self) -> int:
        """How many instances are created and not yet released."""
        return len(self._instances)

    @abc.abstractmethod
    async def execute(
        self, instance_id: str, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one tool call.

        Args:
            instance_id: From :meth:`create`.
            parameters: Arguments the model passed (already checked against the schema by the loop).

        Returns:
            ``(response, step_reward, metrics)``.
        """

    async def calc_reward(self, instance_id: str) -> float:
        """The tool's reward for the trajectory so far (default 0.0).

        Args:
            instance_id: From :meth:`create`.
        """
        self.state(instance_id)
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Drop the instance's state. Releasing an unknown id is a no-op, so a loop can release
        in a ``finally`` block after a failed create.

        Args:
            instance_id: From :meth:`create`.
        """
        self._instances.pop(instance_id, None)
        self._lifecycle_kwargs.pop(instance_id, None)
