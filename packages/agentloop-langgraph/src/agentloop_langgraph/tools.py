"""LangChain tools over agentloop tools (``BaseTool``, ``@function_tool``, MCP).

Each adapter is bound to one trajectory's tool instance (``BaseTool.create``), keeps the tool's
exact OpenAI schema (so the prompt renders exactly as in the ``tool_agent`` loop) and turns
every failure into a ``ToolMessage`` with ``status="error"`` (``handle_tool_error``): a broken
tool is something the model should read about, not an exception that ends the graph. Calls go
through ``BaseTool.run_execute``, so the row's ``execute_kwargs`` reach the tool as in the
``tool_agent`` loop.

Images a tool returns join its ``ToolMessage`` as LangChain's standard image blocks
(``{"type": "image", "base64": ..., "mime_type": "image/png"}``), images first, then one text
block, as in the ``tool_agent`` loop; each is screened first (the trajectory's
:meth:`ChatModel.media_screen <agentloop_langgraph.ChatModel.media_screen>`: limits,
``max_images``, a text-only model, videos) and refused with error text the model reads. The
processed image goes to the trajectory with its block (``adopt_image``), so the PNG written
into the message is neither decoded nor processed again when the next model call renders it.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool as LangChainBaseTool
from langchain_core.tools import ToolException
from pydantic import ConfigDict, Field

from agentloop_core.vision import ImageLimits
from agentloop_tools.base import BaseTool
from agentloop_tools.schema import ToolResponse
from agentloop_tools.tool_media import MEDIA_COUNTERS, MediaScreen, tool_limits
from agentloop_tools.truncation import TruncateSide, cut_tool_response


class AgentLoopTool(LangChainBaseTool):
    """One agentloop tool instance as a LangChain tool.

    Build it with :func:`to_langchain_tool`; ``tool.create`` must already have returned
    ``instance_id``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    tool: Any = Field(exclude=True)
    """The agentloop :class:`~agentloop_tools.base.BaseTool`."""
    instance_id: str
    """The trajectory's instance of the tool."""
    openai_schema: dict[str, Any]
    """The tool's OpenAI function schema, exactly as it declared it."""
    timeout_s: float | None = 60.0
    """Time limit of one call (the tool's own ``timeout_s`` wins); None: no limit."""
    max_tool_response_length: int | None = 1024
    """Most characters of a response shown to the model (the tool loops' key of that name);
    None: no character limit."""
    max_tool_response_tokens: int | None = None
    """Most tokens of a response shown to the model, counted with ``tokenizer`` (the tool
    loops' key of that name); None: no token limit."""
    tokenizer: Any = Field(default=None, exclude=True)
    """The loop's tokenizer; needed with ``max_tool_response_tokens``."""
    tool_response_truncate_side: TruncateSide = "middle"
    """Which part of a long response to keep (see ``truncate_text``)."""
    rewards: list[float] = Field(default_factory=list)
    """Step rewards of this instance's calls, in order."""
    calls: int = 0
    """How many calls were made."""
    errors: int = 0
    """How many calls failed."""
    unavailable: str | None = None
    """Why the tool cannot run for this trajectory (its ``create`` failed), or None."""
    max_parallel_calls: int | None = None
    """Most tool calls of one turn that may run (named in the error message); None: no limit."""
    is_over_limit: Callable[[str], bool] | None = Field(default=None, exclude=True)
    """Tells, by tool call id, whether a call came after ``max_parallel_calls`` others in its
    turn (``ChatModel.is_call_over_limit`` of the trajectory); None: never."""
    calls_over_limit: int = 0
    """How many calls were answered with an error because of ``max_parallel_calls``."""
    truncated_length: int = 0
    """How many responses ``max_tool_response_length`` cut."""
    truncated_tokens: int = 0
    """How many responses ``max_tool_response_tokens`` cut."""
    media_screen: Callable[[], MediaScreen] | None = Field(default=None, exclude=True)
    """Gives the screen of this call's images and videos (``ChatModel.media_screen`` of the
    trajectory); None: every image is refused as for a text-only model (uncounted)."""
    adopt_image: Callable[[str, Any], None] | None = Field(default=None, exclude=True)
    """Hands an image block's data URL and its processed
    :class:`~agentloop_core.vision.ImageItem` to the trajectory (``ChatModel.adopt_image``),
    which then reuses the item when the block enters; None: the block is processed again then."""
    # Always on here (a failing call is answered to the model, never raised); pydantic needs the
    # annotation, which narrows the base's union.
    handle_tool_error: bool = True  # pyright: ignore[reportIncompatibleVariableOverride]

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        """Run a call, or answer it with an error when it is past ``max_parallel_calls`` in its
        turn. The id of a call is only seen here (``ToolNode`` passes the whole tool call), not in
        ``_arun``."""
        call_id = input.get("id") if isinstance(input, dict) and input.get("type") == "tool_call" else None
        if call_id is not None and self.is_over_limit is not None and self.is_over_limit(call_id):
            self.calls += 1
            self.errors += 1
            self.calls_over_limit += 1
            # The tool_agent loop's wording, so both loops show the model the same text.
            return ToolMessage(
                content=f"Error: too many tool calls in one turn (limit {self.max_parallel_calls}); this call "
                        f"to {self.name!r} was not run. Call it again next turn.",
                tool_call_id=call_id, name=self.name, status="error")
        return await super().ainvoke(input, config, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"tool {self.name!r} is async only: run the graph with ainvoke/astream")

    async def _arun(self, *args: Any, run_manager: Any = None, **kwargs: Any) -> str | list[dict[str, Any]]:
        self.calls += 1
        if self.unavailable is not None:
            self.errors += 1
            raise ToolException(f"Error: tool {self.name!r} is unavailable ({self.unavailable}).")
        if args:
            self.errors += 1
            raise ToolException(f"Error: tool {self.name!r} takes keyword arguments only.")
        timeout = self.tool.timeout_s if self.tool.timeout_s is not None else self.timeout_s
        try:
            result = await asyncio.wait_for(self.tool.run_execute(self.instance_id, dict(kwargs)), timeout)
        except asyncio.TimeoutError:
            self.errors += 1
            raise ToolException(f"Error: tool {self.name!r} timed out after {timeout:g} s.") from None
        except Exception as exc:  # noqa: BLE001 - a tool bug becomes text for the model
            self.errors += 1
            raise ToolException(f"Error: tool {self.name!r} failed: {type(exc).__name__}: {exc}") from None
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], ToolResponse)):
            self.errors += 1
            raise ToolException(f"Error: tool {self.name!r} returned an invalid result.")
        response, reward, _metrics = result
        try:
            self.rewards.append(float(reward or 0.0))
        except (TypeError, ValueError):
            self.errors += 1
            self.rewards.append(0.0)
        cut = cut_tool_response(response.text or "", self.tool_response_truncate_side,
                                max_length=self.max_tool_response_length, max_tokens=self.max_tool_response_tokens,
                                tokenizer=self.tokenizer)
        self.truncated_length += cut.by_length
        self.truncated_tokens += cut.by_tokens
        if not (response.image or response.video):
            return cut.text
        screen = self.media_screen() if self.media_screen is not None else MediaScreen(
            None, tool_limits(ImageLimits()), 0, dict.fromkeys(MEDIA_COUNTERS, 0))
        content = screen.tool_content(self.name, cut.text, response.image, response.video)
        if isinstance(content, str):
            return content
        blocks = [_block(screen, part, self.adopt_image) for part in content]
        if all(b["type"] == "text" for b in blocks):  # the processor refused every image
            return "\n".join(b["text"] for b in blocks)
        return blocks


def _block(screen: MediaScreen, part: dict[str, Any],
           adopt: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """A part of ``MediaScreen.tool_content`` as a LangChain content block: a decoded image as
    a standard base64 PNG block (lossless: it decodes to the same pixels, and the message stays
    serialisable), once the model's processor has taken it (the processed item goes to
    ``adopt`` with the block's data URL); one the processor refuses (an extreme aspect ratio)
    as error text, counted as refused, so it cannot fail the trajectory when the message is
    rendered."""
    if part.get("type") != "image":
        return part
    image, processor = part["image"], screen.processor
    # An image part exists only when the screen has a processor (it refuses images without one).
    assert processor is not None
    try:
        item = processor.process(image)
    except Exception as exc:  # noqa: BLE001 - any processor refusal means the same to the model
        screen.taken -= 1
        screen.counters["tool_images"] -= 1
        screen.counters["tool_images_refused"] += 1
        return {"type": "text", "text": f"Error: an image was not shown ({str(exc)[:300]})."}
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    if adopt is not None:
        adopt(f"data:image/png;base64,{data}", item)  # the source messages.content_parts gives this block
    return {"type": "image", "base64": data, "mime_type": "image/png"}


def to_langchain_tool(tool: BaseTool, instance_id: str, **options: Any) -> AgentLoopTool:
    """Wrap one created tool instance as a LangChain tool.

    Args:
        tool: The agentloop tool.
        instance_id: From ``await tool.create(...)``.
        **options: ``timeout_s``, ``max_tool_response_length``, ``max_tool_response_tokens`` and
            ``tokenizer``, ``tool_response_truncate_side``,
            ``max_parallel_calls`` and ``is_over_limit``, ``unavailable``, ``media_screen``,
            ``adopt_image``.

    Raises:
        TypeError: when ``tool`` is not an agentloop ``BaseTool``.
    """
    if not isinstance(tool, BaseTool):
        raise TypeError(f"to_langchain_tool needs an agentloop_tools.BaseTool, got {type(tool).__name__}; "
                        "wrap plain functions with @function_tool first")
    schema = tool.tool_schema.model_dump(exclude_none=True)
    function = schema["function"]
    return AgentLoopTool(
        name=tool.name,
        description=function.get("description") or tool.name,
        args_schema=function.get("parameters") or {"type": "object", "properties": {}},
        tool=tool, instance_id=instance_id, openai_schema=schema, **options,
    )


__all__ = ["AgentLoopTool", "to_langchain_tool"]
