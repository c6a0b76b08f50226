"""The built-in vision task: the answer is only in a picture that a tool returns.

A card lies face down; the model must call ``show_card``, look at the picture the tool returns
(a square of one of ten colours, at a random place, its shade jittered), and answer with the
colour's name as ``#### name``. The prompt is the same for every card but its number, so
nothing but the image tells the colours apart: a model answers right only by looking.

As in the calculator task, the SFT teacher is biased: for three colours it names the
neighbouring colour in most demonstrations (orange -> red, cyan -> blue, pink -> purple). SFT
learns the mistake; GRPO, rewarded only on the answer, can unlearn it.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop_tools.base import BaseTool
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

COLOURS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (215, 35, 35)), ("green", (40, 160, 50)), ("blue", (35, 70, 215)), ("yellow", (235, 215, 40)),
    ("orange", (245, 140, 25)), ("purple", (135, 45, 195)), ("cyan", (30, 200, 210)), ("brown", (120, 75, 35)),
    ("pink", (245, 125, 190)), ("grey", (125, 125, 125)),
)
"""The ten colours a card may show."""
NAMES = tuple(name for name, _ in COLOURS)
BIASED = {"orange": "red", "cyan": "blue", "pink": "purple"}
"""What the biased teacher says instead, for three colours."""
DATA_SOURCE = "agentloop/cards"
AGENT_NAME = "tool_agent"
SYSTEM_PROMPT = "Call show_card to turn the card over, then name its colour as #### colour."
TOOL_NAME = "show_card"
CARD_PIXELS = 56
"""Side of a card picture (56 x 56: 4 x 4 patches of 14 px, 4 image tokens after Qwen2-VL's 2 x 2 merge)."""
TOOL_CONFIG = Path(__file__).parent / "cards_tools.yaml"
"""Tool config of the task (the ``show_card`` tool)."""


@dataclass(frozen=True)
class Card:
    """One face-down card."""

    index: int
    """Its number (in the prompt and the row's ``extra_info``)."""
    colour: str
    """What it shows."""
    seed: int
    """Seed of its picture's placement and shade."""


def card_picture(colour: str, seed: int) -> Any:
    """The card's picture: a square of ``colour`` on white, placed and shaded by ``seed``."""
    from PIL import Image, ImageDraw

    rgb = dict(COLOURS)[colour]
    rng = random.Random(seed)
    image = Image.new("RGB", (CARD_PIXELS, CARD_PIXELS), (255, 255, 255))
    x, y = rng.randint(2, 22), rng.randint(2, 22)
    shade = tuple(max(0, min(255, v + rng.randint(-18, 18))) for v in rgb)
    ImageDraw.Draw(image).rectangle([x, y, x + 30, y + 30], fill=shade)
    return image


def make_cards(n: int, seed: int) -> list[Card]:
    """``n`` cards, colours drawn uniformly with ``seed``."""
    rng = random.Random(seed)
    return [Card(index=seed * 1_000_000 + i, colour=rng.choice(NAMES), seed=rng.getrandbits(31)) for i in range(n)]


class ShowCardTool(BaseTool):
    """Turns the row's card over: returns its picture. The card comes from the row's
    ``tools_kwargs["show_card"]["create_kwargs"]`` (``colour``, ``seed``)."""

    def default_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": TOOL_NAME, "description": "Turn the card over and see its picture.",
            "parameters": {"type": "object", "properties": {}}}})

    async def init_state(self, colour: str = "", seed: int = 0, **extra: Any) -> dict[str, Any]:
        """Raises:
            ValueError: an unknown colour or unexpected keys."""
        if extra:
            raise ValueError(f"tool {self.name!r}: unexpected create kwargs {sorted(extra)}; only 'colour' and 'seed'")
        if colour not in NAMES:
            raise ValueError(f"tool {self.name!r}: colour {colour!r} is not one of {', '.join(NAMES)}")
        return {"colour": colour, "seed": int(seed), "shown": 0}

    # No **kwargs, as BaseTool.execute allows: a row that gives execute_kwargs is an error.
    async def execute(  # pyright: ignore[reportIncompatibleMethodOverride]
            self, instance_id: str, parameters: dict[str, Any]) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self.state(instance_id)
        state["shown"] += 1
        return ToolResponse(text="The card:", image=[card_picture(state["colour"], state["seed"])]), 0.0, {}


def card_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """RL rows (verl's layout) of ``n`` cards: the prompt, the tool's create kwargs, the colour
    as ground truth."""
    return [{"data_source": DATA_SOURCE, "agent_name": AGENT_NAME,
             "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"Card {c.index % 1000}: what colour is it?"}],
             "reward_model": {"style": "rule", "ground_truth": c.colour},
             "extra_info": {"index": c.index, "tools_kwargs": {TOOL_NAME: {"create_kwargs": {
                 "colour": c.colour, "seed": c.seed}}}}} for c in make_cards(n, seed)]


def _data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def card_demonstrations(n: int, seed: int, flip_prob: float = 0.6) -> list[dict[str, Any]]:
    """SFT rows (verl's multi-turn layout, ``messages`` and ``tools``) of ``n`` cards: the call,
    the picture the tool returns (a data URL image part), the teacher's answer; for the colours
    in :data:`BIASED`, the wrong neighbour with chance ``flip_prob``."""
    rng = random.Random(seed * 7919 + 3)
    schema = ShowCardTool({}).tool_schema.model_dump(exclude_none=True)
    rows = []
    for c in make_cards(n, seed):
        said = BIASED[c.colour] if c.colour in BIASED and rng.random() < flip_prob else c.colour
        call_id = f"call_{c.index}"
        rows.append({"messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Card {c.index % 1000}: what colour is it?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": {}}}]},
            {"role": "tool", "name": TOOL_NAME, "tool_call_id": call_id, "content": [
                {"type": "image_url", "image_url": {"url": _data_url(card_picture(c.colour, c.seed))}},
                {"type": "text", "text": "The card:"}]},
            {"role": "assistant", "content": f"#### {said}"},
        ], "tools": [schema], "data_source": DATA_SOURCE, "extra_info": {"index": c.index, "colour": c.colour}})
    return rows

