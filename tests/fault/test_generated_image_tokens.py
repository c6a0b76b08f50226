"""A policy that wants to generate image placeholder tokens must not break its trajectory.

A vision-language prompt expands each image to a run of ``<|image_pad|>`` ids; a generated one
puts more image tokens in the next turn's prompt than there are images, every engine refuses
that prompt and the sample fails. The engines ban the placeholder ids from sampling
(:mod:`agentloop_engines.adapters.placeholders`). Here a multi-turn ``tool_agent`` trajectory with an
image prompt and two image-returning tool calls runs on HFServer serving the tiny Qwen2-VL
edited so the image placeholder is its top choice at every text position (~30 nats ahead) and
the video placeholder its second (``placeholder_preferring_checkpoint``). Each turn the engine
generates freely, then a tool call is appended (a random model never writes one). If this
fails, look at ``RowSampling.banned`` in agentloop_engines/adapters/hf/sampling.py and where HFServer
builds it (``banned_token_ids``)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("agentloop_tools", reason="the tool loop needs agentloop-tools")

from agentloop_conformance.placeholder_model import placeholder_preferring_checkpoint  # noqa: E402
from agentloop_core.protocol import SamplingParams, TokenOutput  # noqa: E402
from agentloop_core.testing.vision_engines import gradient_picture  # noqa: E402
from agentloop_core.vision import load_vision_processor  # noqa: E402
from agentloop_core.vision.content import images_of  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from agentloop_tools.agent_loop import ToolAgentLoop  # noqa: E402
from agentloop_tools.builtin import ImageZoomInTool  # noqa: E402

FREE_TOKENS = 6
"""What the engine generates on its own in each turn before the appended tool call."""


class ThenCall:
    """The real engine's own tokens for each turn, then (for the first turns) a tool call and
    EOS appended, so the trajectory goes on with the engine's tokens in its context."""

    def __init__(self, server: Any, tokenizer: Any, calls: list[str]) -> None:
        self.server = server
        self.capabilities = server.capabilities
        self.calls = [tokenizer.encode("\n" + c, add_special_tokens=False) + [tokenizer.eos_token_id] for c in calls]
        self.outputs: list[TokenOutput] = []
        self.images: list[int] = []

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: Any,
                       **multi_modal: Any) -> TokenOutput:
        self.images.append(len(images_of(multi_modal.get("multi_modal_data"))))
        turn = len(self.outputs)
        sp = SamplingParams.from_mapping(sampling_params)
        if turn < len(self.calls):
            sp = sp.replace(max_tokens=FREE_TOKENS, ignore_eos=True)
        out = await self.server.generate(request_id, prompt_ids, sp, **multi_modal)
        self.outputs.append(out)
        if turn >= len(self.calls):
            return out
        ids = list(out.token_ids) + self.calls[turn]
        return TokenOutput(token_ids=ids, log_probs=[*(out.log_probs or []), *[-1.0] * len(self.calls[turn])],
                           stop_reason="stop")


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """``(folder, tokenizer, processor, config)`` of the placeholder-preferring tiny Qwen2-VL."""
    import transformers

    folder = placeholder_preferring_checkpoint(build_tiny_vlm(initializer_range=0.3),
                                               tmp_path_factory.mktemp("placeholder-vlm"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    return folder, tokenizer, load_vision_processor(folder, tokenizer), config


async def _run(server: HFServer, vlm: Any, temperature: float) -> tuple[Any, ThenCall]:
    folder, tokenizer, processor, _ = vlm
    scene = gradient_picture((64, 48))
    engine = ThenCall(server, tokenizer, [_call("image_zoom_in", bbox_2d=[8, 8, 40, 40], label="corner"),
                                          _call("image_zoom_in", bbox_2d=[0, 0, 32, 24], label="top")])
    loop = ToolAgentLoop(engine, tokenizer, {"tools": {"image_zoom_in": ImageZoomInTool()}, "sanity_check": "strict",
                                             "response_length": 4096, "max_assistant_turns": 3}, processor=processor)
    prompt = [{"role": "user", "content": [{"type": "image", "image": scene}, {"type": "text", "text": "Zoom twice."}]}]
    out = await loop.run({"temperature": temperature, "seed": 1, "logprobs": True, "max_tokens": 8},
                         raw_prompt=prompt, request_id=f"t{temperature}",
                         tools_kwargs={"image_zoom_in": {"create_kwargs": {"image": _png(scene)}}})
    return out, engine


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_a_vision_tool_trajectory_survives_a_policy_that_wants_image_tokens(vlm, temperature):
    """Three turns (two zoom calls, each returning an image) complete: the engine never generated
    a placeholder, every prompt it got held exactly its images' tokens (else HFServer raises), the
    strict sanity check passes, and the only image tokens in the response are the tools' images."""
    folder, _, processor, config = vlm
    banned = {config["image_token_id"], config["video_token_id"]}
    server = HFServer(str(folder), seed=0)
    try:
        out, engine = await _run(server, vlm, temperature)
    finally:
        await server.close()
    generated = [t for o in engine.outputs for t in o.token_ids]
    assert len(engine.outputs) == 3
    assert engine.images == [1, 2, 3]  # every call had the images so far
    assert not banned & set(generated), generated
    assert out.metrics["assistant_turns"] == 3
    assert out.metrics.get("tokenization_mismatch", 0) == 0
    in_response = [m for t, m in zip(out.response_ids, out.response_mask, strict=True) if t in banned]
    assert in_response == [0] * sum(item.num_tokens for item in out.multi_modal_data["image"][1:])


async def test_without_the_ban_the_same_trajectory_breaks(vlm):
    """The protection removed (HFServer's ``banned_token_ids`` emptied): the engine generates the
    image placeholder, and the next turn's prompt, holding more image tokens than images, is
    refused. This is what every vision trajectory of such a policy did before the ban."""
    folder, _, _, config = vlm
    server = HFServer(str(folder), seed=0)
    server.banned_token_ids = ()
    try:
        with pytest.raises(ValueError, match="image tokens"):
            await _run(server, vlm, 0.0)
    finally:
        await server.close()
