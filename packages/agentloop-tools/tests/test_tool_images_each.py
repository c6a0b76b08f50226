"""An image the model's processor refuses costs only itself: ``tool_agent`` and ``env_agent``
on the tiny vision-language model's tokenizer, template and image processor (scripted engine).

Qwen-VL's processor refuses an aspect ratio over 200 although the image is within every limit
of the loop; the other images of the same result, of a parallel call and of an environment's
message are shown, and the model reads which image was refused and why.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch", reason="the tiny VLM needs torch (pip install \"agentloop-engines[hf]\")")
tiny_vlm = pytest.importorskip("agentloop_engines.testing.tiny_vlm", reason="agentloop-engines is not installed")

from PIL import Image  # noqa: E402

from agentloop_core.environment import AssistantTurn, Environment, StepResult, register_environment  # noqa: E402
from agentloop_core.testing.vision_engines import VisionScriptedServer as VisionScripted  # noqa: E402
from agentloop_core.testing.vision_engines import gradient_picture as picture  # noqa: E402
from agentloop_core.vision import image_digest, load_vision_processor  # noqa: E402
from agentloop_tools.agent_loop import ToolAgentLoop  # noqa: E402
from agentloop_tools.base import BaseTool  # noqa: E402
from agentloop_tools.env_agent import EnvAgentLoop  # noqa: E402
from agentloop_tools.schema import ToolResponse  # noqa: E402

SAMPLING = {"temperature": 0.0, "logprobs": True}
GOOD, OTHER = picture((64, 48), seed=1), picture((40, 30), seed=2)
SLIVER = Image.new("RGB", (1, 300), "red")  # within every limit; Qwen-VL refuses an aspect ratio over 200
REFUSED = "absolute aspect ratio must be smaller than 200, got 300.0"


@pytest.fixture(scope="module")
def vlm():
    """``(tokenizer, processor)`` of the tiny VLM."""
    import transformers

    folder = tiny_vlm.build_tiny_vlm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tokenizer, load_vision_processor(folder, tokenizer)


class Returns(BaseTool):
    """Returns the given ToolResponses in turn."""

    def __init__(self, name: str, *responses: ToolResponse) -> None:
        super().__init__({}, {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                                               "parameters": {"type": "object", "properties": {}}}})
        self.responses = list(responses)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        return self.responses.pop(0), 0.0, {}


def call(name: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"


def tool_contents(out) -> list[Any]:
    return [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]


def counts(out) -> tuple[float, float]:
    return out.metrics["tool_images"], out.metrics["tool_images_refused"]


def digests(out) -> list[str]:
    assert out.multi_modal_data is not None
    return [item.digest for item in out.multi_modal_data["image"]]


def check_image_tokens(out, processor) -> None:
    """Each image shown is in ``multi_modal_data`` with exactly its tokens, all mask 0."""
    pad = processor.image_token_id
    assert out.multi_modal_data is not None
    items = out.multi_modal_data["image"]
    assert out.prompt_ids.count(pad) + out.response_ids.count(pad) == sum(item.num_tokens for item in items)
    assert {m for t, m in zip(out.response_ids, out.response_mask, strict=True) if t == pad} == {0}


async def test_one_refused_image_of_a_result_does_not_cost_the_others(vlm):
    tokenizer, processor = vlm
    server = VisionScripted(tokenizer, [call("snap"), "done"], processor.image_token_id)
    tool = Returns("snap", ToolResponse(text="three", image=[GOOD, SLIVER, OTHER]))
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"snap": tool}, "sanity_check": "strict", "response_length": 4096},
                         processor=processor)
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    assert not out.failed, out.metrics
    (content,) = tool_contents(out)
    assert content[0] == {"type": "image", "image": image_digest(GOOD)}
    assert content[1] == {"type": "text", "text": "Error: an image was not shown (tool 'snap' result image 1: the "
                                                  f"model's image processor refused it: {REFUSED})."}
    assert content[2] == {"type": "image", "image": image_digest(OTHER)}
    assert content[3] == {"type": "text", "text": "three"}
    assert digests(out) == [image_digest(GOOD), image_digest(OTHER)]
    assert [len(images) for images in server.images] == [0, 2]
    assert counts(out) == (2, 1)
    check_image_tokens(out, processor)


async def test_a_refused_image_of_one_parallel_call_does_not_cost_the_other_call(vlm):
    tokenizer, processor = vlm
    server = VisionScripted(tokenizer, [call("snap") + "\n" + call("snap"), "done"], processor.image_token_id)
    tool = Returns("snap", ToolResponse(text="one", image=[GOOD]), ToolResponse(text="two", image=[SLIVER]))
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"snap": tool}, "sanity_check": "strict", "response_length": 4096},
                         processor=processor)
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Take two pictures."}])

    assert not out.failed, out.metrics
    first, second = tool_contents(out)
    assert first == [{"type": "image", "image": image_digest(GOOD)}, {"type": "text", "text": "one"}]
    assert second[0]["type"] == "text"
    assert REFUSED in second[0]["text"]
    assert second[0]["text"].startswith("Error: an image was not shown (tool 'snap' result image 0: ")
    assert second[1] == {"type": "text", "text": "two"}
    assert digests(out) == [image_digest(GOOD)]
    assert counts(out) == (1, 1)
    check_image_tokens(out, processor)


async def test_each_tool_image_is_processed_once(vlm, monkeypatch):
    tokenizer, processor = vlm
    seen: list[tuple[int, int]] = []
    process = type(processor).process
    monkeypatch.setattr(processor, "process", lambda image: (seen.append(image.size), process(processor, image))[1])
    server = VisionScripted(tokenizer, [call("snap"), "done"], processor.image_token_id)
    tool = Returns("snap", ToolResponse(text="two", image=[GOOD, OTHER]))
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"snap": tool}, "sanity_check": "strict", "response_length": 4096},
                         processor=processor)
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    assert counts(out) == (2, 0)
    assert sorted(seen) == sorted([GOOD.size, OTHER.size])


@register_environment("test_vision_env_each_image")
class SliverEnv(Environment):
    """Shows two images around one the processor refuses, then ends."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        if turn.index == 0:
            return StepResult([{"role": "user", "content": [
                {"type": "image", "image": GOOD}, {"type": "image", "image": SLIVER},
                {"type": "image", "image": OTHER}, {"type": "text", "text": "and?"}]}], 0.0, False, {})
        return StepResult([], 1.0, True, {})


async def test_an_environment_image_the_processor_refuses_costs_only_itself(vlm):
    tokenizer, processor = vlm
    server = VisionScripted(tokenizer, ["show me", "ok"], processor.image_token_id)
    loop = EnvAgentLoop(server, tokenizer, {"environment": "test_vision_env_each_image", "sanity_check": "strict",
                                            "response_length": 4096}, processor=processor)
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    assert not out.failed, out.metrics
    shown = out.extra_fields["messages"][2]["content"]
    assert shown[0] == {"type": "image", "image": image_digest(GOOD)}
    assert shown[1]["type"] == "text"
    assert REFUSED in shown[1]["text"]
    assert shown[1]["text"].startswith("Error: an image was not shown (environment 'test_vision_env_each_image' "
                                       "step 0 message 0, content[1]: the model's image processor refused it")
    assert shown[2:] == [{"type": "image", "image": image_digest(OTHER)}, {"type": "text", "text": "and?"}]
    assert digests(out) == [image_digest(GOOD), image_digest(OTHER)]
    assert counts(out) == (2, 1)
    check_image_tokens(out, processor)
