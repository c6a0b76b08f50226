"""Calling the judge: an OpenAI-compatible chat endpoint or the policy's own engine, with a
timeout per call, retries, a concurrency limit and the cost of every attempt.

In ``reward.judge.mode=single`` each trajectory is judged on its own as it finishes (one chat
request per trajectory): the rollout worker scores a trajectory while the others still roll
out, so the judge calls of a step run concurrently, at most ``max_concurrency`` at once, and the
judge server batches whatever is in flight (``agentloop serve`` and vLLM do). In ``mode=group``
one request per GRPO group, once the group is rolled out
(:mod:`agentloop_trainer.reward.group_judge`), through the same client.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentloop_trainer.reward.judge import POLICY, JudgeError, JudgeSettings
from agentloop_trainer.reward.rubric import RESERVED

T = TypeVar("T")

DEFAULT_MAX_RESPONSE_BYTES = 4 << 20
"""Most bytes a judge server's answer may have (4 MiB: a chat reply of tens of thousands of
tokens); more is refused unread (:class:`JudgeResponseTooLargeError`)."""

COST_KEYS = RESERVED
"""The per-trajectory counters :class:`JudgeCost` writes as ``judge/<key>`` metrics, and the
step sums them (:func:`judge_step_metrics`); in group mode a group's cost is on its first
judged trajectory. No rubric criterion may take one of these names."""


@dataclass
class JudgeCost:
    """What judging one trajectory cost, over all its attempts."""

    calls: int = 0
    """Requests sent."""
    failed_calls: int = 0
    """Requests that timed out, failed, or replied without a parseable score."""
    prompt_tokens: int = 0
    """Prompt tokens, from the server's ``usage`` (the policy engine: the rendered prompt)."""
    completion_tokens: int = 0
    """Reply tokens, likewise."""
    seconds: float = 0.0
    """Wall time of the requests (not of waiting for a ``max_concurrency`` slot)."""
    failures: int = 0
    """1 when the judgement failed after every retry."""

    def metrics(self) -> dict[str, float]:
        """``judge/<key>`` for each of :data:`COST_KEYS`."""
        return {f"judge/{k}": float(getattr(self, k)) for k in COST_KEYS}


@dataclass
class Verdict:
    """A judgement: the score (mapped onto the range), the reply it came from, and the cost."""

    score: float
    """The parsed score, mapped by ``score_range``."""
    reply: str
    """The judge's reply text."""
    cost: JudgeCost
    """What it cost."""
    parts: dict[str, float] = field(default_factory=dict)
    """Each rubric criterion's mapped score (empty without a rubric)."""


class JudgeFailed(JudgeError):
    """A :class:`JudgeError` that carries the cost of the failed attempts."""

    def __init__(self, message: str, cost: JudgeCost) -> None:
        super().__init__(message)
        self.cost = cost


class JudgeResponseTooLargeError(RuntimeError):
    """The judge server sent more than ``max_response_bytes``: refused before it is parsed."""


class JudgeClient:
    """Sends judge prompts; one per rollout worker process (it pickles to its settings).

    Args:
        settings: The checked ``reward.judge`` settings.
        max_response_bytes: Most bytes read from the judge server per answer (a body over it is
            refused unread, and a server that never ends its body cannot grow the process); None:
            the settings' ``max_response_bytes`` when they have one, else
            :data:`DEFAULT_MAX_RESPONSE_BYTES`.
    """

    def __init__(self, settings: JudgeSettings, *, max_response_bytes: int | None = None) -> None:
        self.settings = settings
        self.max_response_bytes = int(max_response_bytes or settings.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES)
        """Most bytes read from the judge server per answer."""
        self.policy_server: Any = None
        """The engine ``url=policy`` judges with (bound by the rollout fleet in its process)."""
        self._limits: dict[int, asyncio.Semaphore] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings, "max_response_bytes": self.max_response_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], max_response_bytes=state.get("max_response_bytes"))

    def _limit(self) -> asyncio.Semaphore:
        # A semaphore belongs to the event loop it first waits on: one per loop.
        loop = id(asyncio.get_running_loop())
        if loop not in self._limits:
            self._limits[loop] = asyncio.Semaphore(self.settings.max_concurrency)
        return self._limits[loop]

    async def judge(self, prompt: str, tokenizer: Any) -> Verdict:
        """Judge one rendered prompt (single mode): up to ``1 + retries`` attempts, each under
        ``timeout_s``, the reply read by the settings' ``parse_verdict``.

        Raises:
            JudgeFailed: every attempt failed; the message has the last attempt's reason.
        """
        (score, parts), reply, cost = await self.judge_with(prompt, tokenizer, self.settings.parse_verdict)
        return Verdict(score=score, reply=reply, cost=cost, parts=parts)

    async def judge_with(self, prompt: str, tokenizer: Any, parse: Callable[[str], T]) -> tuple[T, str, JudgeCost]:
        """Send ``prompt`` until ``parse`` reads the reply: up to ``1 + retries`` attempts, each
        under ``timeout_s``; a reply ``parse`` raises on counts as a failed attempt.

        Returns:
            ``(what parse returned, the reply, the cost of every attempt)``.

        Raises:
            JudgeFailed: every attempt failed; the message has the last attempt's reason.
        """
        s = self.settings
        cost = JudgeCost()
        reason = ""
        for attempt in range(s.retries + 1):
            if attempt:
                await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))
            reply = None
            try:
                async with self._limit():
                    cost.calls += 1
                    start = time.perf_counter()  # the call's time, not the wait for a slot
                    try:
                        reply, prompt_tokens, completion_tokens = await asyncio.wait_for(
                            self._call(prompt, tokenizer), s.timeout_s)
                    finally:
                        cost.seconds += time.perf_counter() - start
                cost.prompt_tokens += prompt_tokens
                cost.completion_tokens += completion_tokens
                value = parse(reply)
            except asyncio.TimeoutError:
                reason = f"the judge call timed out after reward.judge.timeout_s={s.timeout_s:g}"
            except Exception as exc:  # noqa: BLE001 - any failure is retried, then reported
                reason = f"{type(exc).__name__}: {exc}" if reply is None else f"{exc}; the judge replied {reply[:300]!r}"
            else:
                return value, reply, cost
            cost.failed_calls += 1
        cost.failures = 1
        where = "the policy engine" if s.url == POLICY else s.url
        raise JudgeFailed(f"judge ({where}) failed after {s.retries + 1} attempt(s): {reason}", cost)

    async def _call(self, prompt: str, tokenizer: Any) -> tuple[str, int, int]:
        if self.settings.url == POLICY:
            return await self._call_policy(prompt, tokenizer)
        return await self._call_http(prompt)

    async def _call_http(self, prompt: str) -> tuple[str, int, int]:
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover - httpx comes with huggingface_hub
            raise ImportError('reward.judge.url needs httpx: pip install "agentloop-trainer[judge]"') from exc
        s = self.settings
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "temperature": s.temperature,
                                "max_tokens": s.max_tokens}
        if s.model:
            body["model"] = s.model
        headers = {"Authorization": f"Bearer {os.environ[s.api_key_env]}"} if s.api_key_env else {}
        # Compressed bytes would be counted before they expand (a gzip bomb): ask for none.
        headers["Accept-Encoding"] = "identity"
        # The timeout is asyncio's (the whole call); httpx's own only bounds its socket waits.
        async with httpx.AsyncClient(timeout=s.timeout_s + 5) as client, client.stream(
                "POST", str(s.url).rstrip("/") + "/chat/completions", json=body, headers=headers) as response:
            raw = await self._read_bounded(response)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code} from {s.url}: {raw[:300].decode(errors='replace')}")
        data = json.loads(raw)
        try:
            reply = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"{s.url} answered without choices[0].message.content: {str(data)[:300]}") from None
        usage = data.get("usage") or {}
        return str(reply), int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)

    async def _read_bounded(self, response: Any) -> bytes:
        """The body of a streamed ``httpx`` response, read up to ``max_response_bytes``.

        Raises:
            JudgeResponseTooLargeError: the body (or its Content-Length) passed the limit, or it
                came compressed though none was asked for.
        """
        limit, url = self.max_response_bytes, self.settings.url
        fix = (f"max_response_bytes={limit:,}; a judge reply is a few KB: check that reward.judge.url is the "
               "judge's OpenAI-compatible /v1 endpoint")
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding not in ("", "identity"):
            raise JudgeResponseTooLargeError(f"the judge at {url} sent a {encoding}-encoded body though asked for "
                                             f"none; refused unread (it could expand past {fix})")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise JudgeResponseTooLargeError(f"the judge at {url} announced {int(length):,} bytes, over {fix}; "
                                             "refused unread")
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise JudgeResponseTooLargeError(f"the judge at {url} sent more than {fix}; the rest was not read")
        return bytes(body)

    async def _call_policy(self, prompt: str, tokenizer: Any) -> tuple[str, int, int]:
        from agentloop_core.protocol import SamplingParams

        server = self.policy_server
        if server is None:
            raise RuntimeError("reward.judge.url=policy but no policy engine is bound in this process (the rollout "
                               "fleet binds its engine; on Ray workers give the judge a URL instead)")
        s = self.settings
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        # The judge's prompt is not trained on: encoding its text is fine here.
        prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
        request_id = f"judge-{uuid.uuid4().hex}"
        params = SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens, logprobs=False)
        try:
            out = await server.generate(request_id, prompt_ids, params)
        except asyncio.CancelledError:
            await server.abort(request_id)
            raise
        reply = tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        return reply, len(prompt_ids), len(out.token_ids)


def judge_step_metrics(batch: Any) -> dict[str, float]:
    """A step's judge metrics, read from its trajectories' last segments; empty without a judge:
    each ``judge/<key>`` of :data:`COST_KEYS` summed over the trajectories (failed ones too),
    and each rubric criterion's ``judge/<name>`` averaged over those that have it."""
    rows = batch.last_segment_rows().tolist()
    sample = [batch.sample_metrics[r] for r in rows] if batch.sample_metrics else []
    if not any("judge/calls" in m for m in sample):
        return {}
    out = {f"judge/{k}": float(sum(float(m.get(f"judge/{k}", 0.0)) for m in sample)) for k in COST_KEYS}
    criteria: dict[str, list[float]] = {}
    for m in sample:
        for key, value in m.items():
            if key.startswith("judge/") and key[6:] not in COST_KEYS and isinstance(value, (int, float)):
                criteria.setdefault(key, []).append(float(value))
    out.update({key: sum(values) / len(values) for key, values in sorted(criteria.items())})
    return out
