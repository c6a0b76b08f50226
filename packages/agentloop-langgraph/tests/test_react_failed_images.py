"""A ``react_agent`` sample that fails (``on_history_rewrite="error"``) with an image in its prompt:
the failed output keeps the prompt's ids and the prompt's images with them, so it is counted in
the batch and the trainer's step runs (tiny vision-language model, scripted turns)."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("torch", reason="the tiny VLM needs torch (pip install \"agentloop-engines[hf]\")")
tiny_vlm = pytest.importorskip("agentloop_engines.testing.tiny_vlm", reason="agentloop-engines is not installed")

from langgraph_helpers import hermes_call  # noqa: E402

from agentloop_core.batch import RolloutBatch  # noqa: E402
from agentloop_core.testing.vision_engines import VisionScriptedServer  # noqa: E402
from agentloop_core.testing.vision_engines import gradient_picture as picture  # noqa: E402
from agentloop_core.vision import image_digest, load_vision_processor  # noqa: E402
from agentloop_langgraph import ReactAgentLoop  # noqa: E402
from agentloop_tools.base import BaseTool  # noqa: E402
from agentloop_tools.schema import ToolResponse  # noqa: E402

SAMPLING = {"temperature": 0.0, "logprobs": True}
scene = picture((40, 40))


class Snap(BaseTool):
    """Returns an image on every call."""

    def __init__(self) -> None:
        super().__init__({}, {"type": "function", "function": {"name": "snap", "description": "the snap tool",
                                                               "parameters": {"type": "object", "properties": {}}}})

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="one", image=[picture((32, 32), seed=7)]), 0.0, {}


def _prompt(image) -> list[dict]:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


@pytest.fixture(scope="module")
def vlm():
    """``(folder, tokenizer, processor)`` of the tiny VLM."""
    import transformers

    folder = tiny_vlm.build_tiny_vlm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return folder, tokenizer, load_vision_processor(folder, tokenizer)


async def _run(vlm, graph_factory: str | None):
    _, tokenizer, processor = vlm
    server = VisionScriptedServer(tokenizer, [hermes_call("snap"), hermes_call("snap"), "done"],
                                  processor.image_token_id)
    config = {"tools": {"snap": Snap()}, "sanity_check": "strict", "response_length": 4096,
              "on_history_rewrite": "error"}
    if graph_factory:
        config["graph_factory"] = graph_factory
    return await ReactAgentLoop(server, tokenizer, config, processor=processor).run(SAMPLING, raw_prompt=_prompt(scene))



async def test_a_failed_sample_keeps_its_prompt_images_and_the_trainer_scores_it(vlm):
    folder, _, processor = vlm
    failed = await _run(vlm, "langgraph_helpers:trimming_graph")
    assert not isinstance(failed, list)
    assert failed.failed
    assert "HistoryRewrittenError" in failed.metrics["error"]
    image_id = processor.image_token_id
    assert failed.prompt_ids.count(image_id) > 0
    assert failed.multi_modal_data is not None
    # The prompt's image only, not the tool's: the failure keeps the prompt, not the response.
    assert [item.digest for item in failed.multi_modal_data["image"]] == [image_digest(scene)]
    assert failed.prompt_ids.count(image_id) == failed.multi_modal_data["image"][0].num_tokens

    healthy = await _run(vlm, None)
    assert not isinstance(healthy, list)
    assert not healthy.failed
    batch = RolloutBatch.from_outputs([failed, healthy], pad_token_id=0)
    assert batch.metrics["rollout/num_failed"] == 1
    trainer = pytest.importorskip("agentloop_trainer.update")
    import torch

    from agentloop_engines.adapters.hf.vision import load_model

    model = load_model(str(folder), torch.float32)
    pb = trainer.policy_batch_from_rollout(batch)
    with torch.no_grad():
        logp = trainer.response_log_probs(model, pb)
    assert not pb.response_mask[0].any()
    assert not logp[0].any()
    assert pb.response_mask[1].any()
