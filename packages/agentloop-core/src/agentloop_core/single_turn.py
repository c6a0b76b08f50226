"""The simplest agent loop: render the prompt, generate once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import SamplingParams
from agentloop_core.registry import register
from agentloop_core.stops import StopCounter
from agentloop_core.tokenization import ChatRenderer, Trajectory
from agentloop_core.vision.content import messages_with_row_images, multi_modal_kwargs
from agentloop_core.vision.processor import VisionProcessor


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One ``generate`` call on the rendered ``raw_prompt``.

    Config keys: ``prompt_length`` (a longer prompt is an error), ``response_length`` (caps
    ``max_tokens``), ``sanity_check`` (``strict`` | ``ignore_strippable`` | ``disable``),
    ``apply_chat_template_kwargs``, ``chat_template``, ``use_inference_chat_template``,
    ``allow_special_tokens_in_content``.
    """

    async def run(self, sampling_params: Mapping[str, Any] | SamplingParams, **row: Any) -> AgentLoopOutput:
        """Roll out one sample.

        Args:
            sampling_params: Sampling parameters; ``max_tokens`` is capped by ``response_length``.
            **row: Must hold ``raw_prompt`` (a list of chat messages); ``request_id`` optional.

        Returns:
            The trajectory, with ``metrics["generate_s"]`` and ``extra_fields["messages"]``.

        Raises:
            ValueError: when ``raw_prompt`` is missing or the prompt exceeds ``prompt_length``.
        """
        messages = row.get("raw_prompt")
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                "single_turn_agent needs row['raw_prompt'] as a non-empty list of chat messages, "
                f"got {type(messages).__name__}"
            )
        vision = self.processor if isinstance(self.processor, VisionProcessor) else None
        renderer = ChatRenderer(
            self.processor if self.processor is not None and vision is None else self.tokenizer,
            vision=vision,
            chat_template=self.config.get("chat_template"),
            use_inference_chat_template=bool(self.config.get("use_inference_chat_template", False)),
            apply_chat_template_kwargs=self.config.get("apply_chat_template_kwargs"),
            allow_special_tokens_in_content=bool(self.config.get("allow_special_tokens_in_content", False)),
        )
        if row.get("images") is not None:  # verl's rows: <image> markers and an images column
            messages = messages_with_row_images(messages, row["images"], where="row")
        traj = Trajectory(renderer, messages)
        prompt_length = self.config.get("prompt_length")
        if prompt_length is not None and len(traj.prompt_ids) > prompt_length:
            raise ValueError(
                f"prompt has {len(traj.prompt_ids)} tokens but prompt_length is {prompt_length}; "
                "raise prompt_length or filter long prompts from the dataset"
            )
        params = (
            sampling_params.as_dict()
            if isinstance(sampling_params, SamplingParams)
            else dict(sampling_params)
        )
        turn_cap = int(params["max_tokens"]) if params.get("max_tokens") is not None else None
        response_length = self.config.get("response_length")
        if response_length is not None:
            params["max_tokens"] = min(int(params.get("max_tokens", response_length)), int(response_length))
        requested = int(params.get("max_tokens") or SamplingParams().max_tokens)
        request_id = row.get("request_id") or uuid.uuid4().hex
        start = time.perf_counter()
        with self.tracer.span("generate", request_id=request_id, prompt_tokens=len(traj.prompt_ids)) as span:
            out = await self.server.generate(request_id, traj.context_ids, params, **multi_modal_kwargs(traj.image_items))
            span["response_tokens"] = len(out.token_ids)
            span["stop_reason"] = out.stop_reason
        generate_s = time.perf_counter() - start
        traj.append_generated(out)
        stops = StopCounter()
        stops.add(out.stop_reason, len(out.token_ids), requested, turn_cap)
        return traj.to_output(
            metrics={"generate_s": generate_s, **stops.metrics()},
            extra_fields={"messages": traj.messages, "stop_reason": out.stop_reason},
            sanity_check=self.config.get("sanity_check", "strict"),
        )
