"""What the vision tests compare an engine against: the log-probs a trainer computes with one
full forward of prompt + generation (the model's own positions), and the largest gap."""

from __future__ import annotations

import torch

from agentloop_engines.adapters.placeholders import placeholder_token_ids


def full_forward_log_probs(model, processor, ids: list[int], items, generated: list[int],
                           banned: tuple[int, ...] | None = None) -> list[float]:
    """What a trainer computes for a Qwen-VL model: one forward of prompt + generation, over the
    tokens other than ``banned`` (None: the model's image/video placeholder ids, which every
    engine bans from sampling and leaves out of its log-probs; ``()``: the full vocabulary)."""
    x = torch.tensor([ids + generated])
    kwargs = {}
    if items:
        inputs = processor.model_inputs(items)
        kwargs = {"pixel_values": torch.from_numpy(inputs["pixel_values"]),
                  "image_grid_thw": torch.from_numpy(inputs["image_grid_thw"]),
                  "mm_token_type_ids": (x == processor.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), **kwargs).logits[0].float()
    banned = placeholder_token_ids(model.config, logits.shape[-1]) if banned is None else banned
    if banned:
        logits[:, list(banned)] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    n = len(ids)
    return [lp[n - 1 + j, t].item() for j, t in enumerate(generated)]


def gap(a: list[float] | None, b: list[float] | None) -> float:
    """The largest absolute difference of two log-prob lists of one length."""
    assert a is not None
    assert b is not None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def data_url(image, fmt: str = "PNG") -> str:
    """``image`` as a ``data:`` URL of its ``fmt`` encoding."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(image) -> dict:
    """An OpenAI ``image_url`` content part holding ``image`` as a PNG data URL."""
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def token_runs(ids: list[int], token_id: int) -> list[int]:
    """Lengths of the runs of ``token_id`` in ``ids``, in order."""
    runs, n = [], 0
    for t in [*ids, None]:
        if t == token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


async def two_turns_with_an_image_each(server, processor, first, second, max_tokens: int):
    """An OpenAI-client agent through the recording gateway: turn 1 shows ``first``, turn 2
    continues the conversation with ``second``. Returns the one output segment and the
    messages each call added (``sent``)."""
    import openai

    from agentloop_engines.serving.http_agent import HTTPAgentLoop, close_gateways

    sent: list[list[dict]] = []

    def agent(base_url: str, row: dict) -> None:
        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(first)]}]
        sent.append(list(messages))
        reply = c.chat.completions.create(model="any", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": [image_part(second), {"type": "text", "text": "And this one?"}]}]
        sent.append(messages[-1:])
        c.chat.completions.create(model="any", messages=messages)

    loop = HTTPAgentLoop(server, server.tokenizer, {"agent": agent}, processor=processor)
    try:
        outputs = await loop.run({"temperature": 0.0, "max_tokens": max_tokens}, index=0)
    finally:
        close_gateways()
    assert len(outputs) == 1, "the second call continues the first: one segment"
    return outputs[0], sent


def rebuilt_by_core(server, processor, out, sent):
    """Core's ``Trajectory`` over the messages ``sent`` and the engine's generated ids of
    ``out`` (its mask-1 runs): what the gateway's row must equal."""
    from agentloop_core.protocol import TokenOutput
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_engines.testing.gateway_fixtures import generated_runs

    runs = generated_runs(out)
    assert len(runs) == 2
    reasons = out.extra_fields["stop_reasons"]
    trajectory = Trajectory(ChatRenderer(server.tokenizer, vision=processor), sent[0])
    trajectory.append_generated(TokenOutput(token_ids=runs[0], log_probs=None, stop_reason=reasons[0]))
    trajectory.append_messages(sent[1])
    trajectory.append_generated(TokenOutput(token_ids=runs[1], log_probs=None, stop_reason=reasons[1]))
    return trajectory
