"""Pad agent loop outputs into the fixed-shape arrays a trainer consumes."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop_core.batch_images import cut_row
from agentloop_core.output import AgentLoopOutput
from agentloop_core.segments import trajectory_reward
from agentloop_core.stops import STOP_METRICS, stopped_on_a_limit, truncation_metrics

logger = logging.getLogger(__name__)


class SequenceTooLongError(ValueError):
    """An output does not fit in ``prompt_length`` / ``response_length``."""


@dataclass
class RolloutBatch:
    """A padded rollout batch of ``B`` rows. Arrays are numpy; see :meth:`to_torch`.

    A row is one segment of a trajectory: one row per sample, unless its loop split the
    trajectory into segments (:mod:`agentloop_core.segments`). ``trajectory_index`` and
    ``segment_index`` say which sample and which segment a row is; the segments of a
    trajectory share its reward and its failed flag. Per-trajectory values (reward, turns,
    timings, counters) are read from its last segment.

    Prompts are left-padded to ``P`` and responses right-padded to ``R`` so every prompt ends
    and every response starts at column ``P`` of ``input_ids``.
    """

    prompts: np.ndarray
    """[B, P] int64 prompt ids, left-padded with ``pad_token_id``."""
    responses: np.ndarray
    """[B, R] int64 response ids (generated and tool/user tokens), right-padded."""
    response_mask: np.ndarray
    """[B, R] int64: 1 for a token the engine generated, 0 for tool/user tokens and padding."""
    input_ids: np.ndarray
    """[B, P+R] int64: ``prompts`` then ``responses``."""
    attention_mask: np.ndarray
    """[B, P+R] int64: 1 for every real token (prompt, generated, tool), 0 for padding."""
    position_ids: np.ndarray
    """[B, P+R] int64: ``cumsum(attention_mask) - 1`` clipped at 0."""
    rollout_log_probs: np.ndarray | None
    """[B, R] float32 engine log-probs (0 where the mask is 0), or None when no loop asked for them."""
    rewards: np.ndarray
    """[B] float32 the trajectory's ``reward_score`` (every segment gets it); 0 where it is
    missing, NaN, or the sample failed."""
    has_reward: np.ndarray
    """[B] bool: the loop returned a finite ``reward_score`` (reward functions fill the rest)."""
    num_turns: np.ndarray
    """[B] int64 messages per conversation."""
    failed: np.ndarray
    """[B] bool: the loop raised or timed out (on any segment of the trajectory); a failed
    sample is one row holding no response. Mask it out of the loss."""
    truncated: np.ndarray
    """[B] bool: the prompt or response was cut to fit (only with ``truncate=True``)."""
    trajectory_index: np.ndarray
    """[B] int64: the sample (trajectory) each row belongs to, the output's
    ``trajectory_index``: from the manager, the row's index in the rows rolled out (hence its
    prompt and ``rollout_n``). Outputs without one count as a trajectory each, numbered by
    position."""
    segment_index: np.ndarray
    """[B] int64: the row's position among its trajectory's segments (0 for one segment)."""
    pad_token_id: int
    """The id used for padding."""
    extra_fields: list[dict[str, Any]] = field(default_factory=list)
    """Per-sample ``extra_fields`` from each loop, in batch order."""
    sample_metrics: list[dict[str, Any]] = field(default_factory=list)
    """Per-sample ``metrics`` (timings, ``agent_name``, ``error``), in batch order."""
    multi_modal_data: list[dict[str, Any] | None] = field(default_factory=list)
    """Per-row ``multi_modal_data``: the output's, or for a row cut to fit only the images whose
    tokens the row kept."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch metrics: failures, lengths, rewards, and per-sample timing min/max/mean
    (:func:`batch_metrics`); in a batch with images, ``rollout/num_images_cut``: the images
    that rows cut to fit lost with their tokens."""

    ARRAY_FIELDS = (
        "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
        "rollout_log_probs", "rewards", "has_reward", "num_turns", "failed", "truncated",
        "trajectory_index", "segment_index",
    )  # fmt: skip

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def num_failed(self) -> int:
        """How many samples (trajectories) failed."""
        return int(np.unique(self.trajectory_index[self.failed]).size)

    @property
    def num_trajectories(self) -> int:
        """How many samples (trajectories) the rows hold."""
        return int(np.unique(self.trajectory_index).size)

    def last_segment_rows(self) -> np.ndarray:
        """[T] the row of each trajectory's last segment, trajectories in ascending
        ``trajectory_index``: where per-trajectory values (reward, failed, turns) are read.
        For a batch of one segment per sample, ``arange(B)`` in sample order."""
        return last_segment_rows(self.trajectory_index, self.segment_index)

    def stopped_on_a_limit(self) -> np.ndarray:
        """[B] bool: the row's trajectory was cut short: one of its turns stopped on a length
        limit (the per-turn cap, the engine's context, the response budget:
        :func:`agentloop_core.stops.stopped_on_a_limit` of any of its rows' ``sample_metrics``)
        or padding cut one of its rows (``truncated``). True on every row of such a trajectory."""
        cut = self.truncated.astype(bool).copy()
        for row, m in enumerate(self.sample_metrics):
            cut[row] |= stopped_on_a_limit(m)
        return np.isin(self.trajectory_index, self.trajectory_index[cut])

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields by name (``rollout_log_probs`` left out when None)."""
        out = {name: getattr(self, name) for name in self.ARRAY_FIELDS}
        return {k: v for k, v in out.items() if v is not None}

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The array fields as torch tensors (imports torch now, not at module import).

        Raises:
            ImportError: when torch is not installed.
        """
        try:
            import torch
        except ImportError as exc:
            raise ImportError("RolloutBatch.to_torch needs torch: pip install torch") from exc
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in self.arrays().items()}

    @classmethod
    def from_outputs(
        cls,
        outputs: Sequence[AgentLoopOutput],
        *,
        prompt_length: int | None = None,
        response_length: int | None = None,
        pad_token_id: int | None = None,
        tokenizer: Any = None,
        truncate: bool = False,
    ) -> RolloutBatch:
        """Pad outputs into a batch.

        Args:
            outputs: One output per sample, or per segment of a sample (then every output
                carries its ``trajectory_index`` and ``segment_index``, as the worker sets
                them), in batch order.
            prompt_length: Prompt width ``P``; None: the longest prompt in the batch.
            response_length: Response width ``R``; None: the longest response in the batch.
            pad_token_id: Padding id; None: the tokenizer's ``pad_token_id``, else its
                ``eos_token_id``.
            tokenizer: Where to find the pad id when ``pad_token_id`` is None.
            truncate: Cut prompts on the left and responses on the right to fit, flagging the
                samples in ``truncated`` and logging a warning. False: raise instead. A cut never
                splits an image's tokens: it moves to the image's edge, and the images whose tokens
                it removes leave the row's ``multi_modal_data`` (counted in
                ``rollout/num_images_cut``; :mod:`agentloop_core.batch_images`).

        Returns:
            The padded batch with its metrics.

        Raises:
            SequenceTooLongError: an output is longer than the widths and ``truncate`` is False.
            ValueError: no pad id, an empty batch, log-probs present for some samples only,
                ``trajectory_index`` on some outputs only, segment indices of a trajectory
                that are not 0..n-1, or segments of one trajectory holding different rewards.
        """
        if not outputs:
            raise ValueError("cannot build a RolloutBatch from zero outputs")
        pad = _pad_id(pad_token_id, tokenizer)
        for i, out in enumerate(outputs):
            if not isinstance(out, AgentLoopOutput):
                raise TypeError(f"output {i} is a {type(out).__name__}, not an AgentLoopOutput")
            out.validate()
        trajectory_index, segment_index = _segment_indices(outputs)
        P = prompt_length if prompt_length is not None else max(1, max(len(o.prompt_ids) for o in outputs))
        R = (
            response_length
            if response_length is not None
            else max(1, max(len(o.response_ids) for o in outputs))
        )
        if P < 1 or R < 1:
            raise ValueError(f"prompt_length and response_length must be >= 1, got {P} and {R}")
        B = len(outputs)

        has_lp = [o.response_logprobs is not None for o in outputs]
        alive_lp = [h for h, o in zip(has_lp, outputs, strict=True) if not (o.failed or not o.response_ids)]
        if any(alive_lp) and not all(alive_lp):
            missing = [
                i
                for i, o in enumerate(outputs)
                if o.response_ids and not o.failed and o.response_logprobs is None
            ]
            raise ValueError(
                f"samples {missing[:10]} have no response_logprobs while others do; request "
                "logprobs for every sample (sampling_params logprobs=True) or for none"
            )
        want_lp = any(has_lp)

        prompts = np.full((B, P), pad, dtype=np.int64)
        responses = np.full((B, R), pad, dtype=np.int64)
        response_mask = np.zeros((B, R), dtype=np.int64)
        prompt_attn = np.zeros((B, P), dtype=np.int64)
        response_attn = np.zeros((B, R), dtype=np.int64)
        log_probs = np.zeros((B, R), dtype=np.float32) if want_lp else None
        truncated = np.zeros(B, dtype=bool)
        images = [o.multi_modal_data for o in outputs]
        images_cut = 0

        for i, out in enumerate(outputs):
            p_ids, r_ids = out.prompt_ids, out.response_ids
            r_mask, r_lp = out.response_mask, out.response_logprobs
            if len(p_ids) > P or len(r_ids) > R:
                if not truncate:
                    raise SequenceTooLongError(
                        f"sample {i}: prompt has {len(p_ids)} tokens (prompt_length={P}) and response "
                        f"has {len(r_ids)} tokens (response_length={R}); raise prompt_length/"
                        "response_length, make the loop respect response_length, or pass "
                        "truncate=True to cut and flag such samples"
                    )
                truncated[i] = True
                # Never inside an image's tokens; the images cut away leave the row (batch_images).
                cut = cut_row(p_ids, r_ids, P, R, images[i])
                images[i], images_cut = cut.multi_modal_data, images_cut + cut.images_cut
                logger.warning(
                    "sample %d truncated: prompt %d->%d tokens, response %d->%d tokens (%d generated tokens "
                    "dropped, %d image(s) cut)", i, len(p_ids), len(p_ids) - cut.prompt_start, len(r_ids),
                    cut.response_end, sum(r_mask[cut.response_end :]), cut.images_cut,
                )  # fmt: skip
                p_ids = p_ids[cut.prompt_start :]
                r_ids, r_mask = r_ids[: cut.response_end], r_mask[: cut.response_end]
                r_lp = r_lp[: cut.response_end] if r_lp is not None else None
                if not cut.images_fit:
                    logger.warning(
                        "sample %d: its %d image(s) do not fill its image tokens, so none can be kept in its cut; "
                        "it trains nothing (mask 0). The loop must return multi_modal_data={'image': "
                        "trajectory.image_items}, its images in token order", i, cut.images_cut,
                    )  # fmt: skip
                    r_mask = [0] * len(r_mask)
            n_p, n_r = len(p_ids), len(r_ids)
            if n_p:
                prompts[i, P - n_p :] = p_ids
                prompt_attn[i, P - n_p :] = 1
            if n_r:
                responses[i, :n_r] = r_ids
                response_mask[i, :n_r] = r_mask
                response_attn[i, :n_r] = 1
                if log_probs is not None and r_lp is not None:
                    # Tool/user tokens carry no engine log-prob whatever the loop stored there.
                    log_probs[i, :n_r] = np.asarray(r_lp, dtype=np.float32) * np.asarray(
                        r_mask, dtype=np.float32
                    )

        attention_mask = np.concatenate([prompt_attn, response_attn], axis=1)
        position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None).astype(np.int64)
        failed = np.array([o.failed for o in outputs], dtype=bool)
        # A trajectory failed if any of its segments did; its reward is its last segment's.
        failed_trajectories = np.unique(trajectory_index[failed])
        failed = np.isin(trajectory_index, failed_trajectories)
        by_trajectory: dict[int, list[AgentLoopOutput]] = {}
        for t, out in sorted(
            zip(trajectory_index.tolist(), outputs, strict=True), key=lambda x: (x[0], x[1].segment_index)
        ):
            by_trajectory.setdefault(t, []).append(out)
        failed_set = set(failed_trajectories.tolist())
        reward_of = {t: None if t in failed_set else trajectory_reward(segs) for t, segs in by_trajectory.items()}
        raw_rewards = [reward_of[t] for t in trajectory_index.tolist()]
        has_reward = np.array(
            [
                r is not None and math.isfinite(float(r)) and not f
                for r, f in zip(raw_rewards, failed, strict=True)
            ],
            dtype=bool,
        )
        rewards = np.array(
            [float(r) if h and r is not None else 0.0 for r, h in zip(raw_rewards, has_reward, strict=True)], dtype=np.float32
        )

        batch = cls(
            prompts=prompts,
            responses=responses,
            response_mask=response_mask,
            input_ids=np.concatenate([prompts, responses], axis=1),
            attention_mask=attention_mask,
            position_ids=position_ids,
            rollout_log_probs=log_probs,
            rewards=rewards,
            has_reward=has_reward,
            num_turns=np.array([o.num_turns for o in outputs], dtype=np.int64),
            failed=failed,
            truncated=truncated,
            trajectory_index=trajectory_index,
            segment_index=segment_index,
            pad_token_id=pad,
            extra_fields=[dict(o.extra_fields) for o in outputs],
            sample_metrics=[dict(o.metrics) for o in outputs],
            multi_modal_data=images,
        )
        batch.metrics = batch_metrics(outputs, batch, response_length=response_length)
        if any((o.multi_modal_data or {}).get("image") for o in outputs):
            batch.metrics["rollout/num_images_cut"] = float(images_cut)
        return batch


def _segment_indices(outputs: Sequence[AgentLoopOutput]) -> tuple[np.ndarray, np.ndarray]:
    """``(trajectory_index, segment_index)`` arrays of the outputs, checked."""
    given = [o.trajectory_index is not None for o in outputs]
    if not any(given):
        trajectory_index = np.arange(len(outputs), dtype=np.int64)
    elif not all(given):
        missing = [i for i, g in enumerate(given) if not g]
        raise ValueError(
            f"outputs {missing[:10]} have no trajectory_index while others do; set it on every output "
            "(the worker does) or on none (each output is then a trajectory of its own)"
        )
    else:
        trajectory_index = np.array([o.trajectory_index for o in outputs], dtype=np.int64)
    segment_index = np.array([o.segment_index for o in outputs], dtype=np.int64)
    seen: dict[int, list[int]] = {}
    for t, k in zip(trajectory_index.tolist(), segment_index.tolist(), strict=True):
        seen.setdefault(t, []).append(k)
    for t, ks in seen.items():
        if sorted(ks) != list(range(len(ks))):
            raise ValueError(
                f"trajectory {t} has segment indices {ks}; its outputs need segment_index 0..{len(ks) - 1}, "
                "one each (the worker numbers a trajectory's outputs in the order run() returned them)"
            )
    return trajectory_index, segment_index


def last_segment_rows(trajectory_index: np.ndarray, segment_index: np.ndarray) -> np.ndarray:
    """[T] the row of each trajectory's last (highest ``segment_index``) segment, trajectories
    in ascending index order."""
    trajectory_index = np.asarray(trajectory_index)
    segment_index = np.asarray(segment_index)
    if trajectory_index.size == 0:
        return np.zeros(0, dtype=np.int64)
    # Sort by trajectory, then segment: the last entry of each trajectory's run is its last segment.
    order = np.lexsort((segment_index, trajectory_index))
    ends = np.flatnonzero(np.diff(trajectory_index[order], append=trajectory_index[order][-1] + 1))
    return order[ends].astype(np.int64)


def _pad_id(pad_token_id: int | None, tokenizer: Any) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
    raise ValueError(
        "no pad token id: pass pad_token_id (config 'pad_token_id') or a tokenizer with a "
        "pad_token_id or eos_token_id"
    )


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}/mean": float(arr.mean()),
        f"{prefix}/max": float(arr.max()),
        f"{prefix}/min": float(arr.min()),
    }


def batch_metrics(
    outputs: Sequence[AgentLoopOutput], batch: RolloutBatch, response_length: int | None = None
) -> dict[str, float]:
    """Batch metrics.

    Per trajectory (one value per sample, read from its last segment): sample and failure
    counts, rewards, ``rollout/num_turns``, ``agent_loop/num_segments/{mean,max}`` (over
    successful samples); for every numeric per-sample metric ending in ``_s``
    (``generate_s``, ``tool_calls_s``, ``reward_s``, ``agent_loop_s``...) its min/max/mean
    over the samples that report it, as ``timing_s/agent_loop/<name>/{min,max,mean}``; and
    for every other numeric per-sample metric (``tool_calls``, ``tool_errors``,
    ``tool/<name>/<key>`` that tools report...) its mean and max over the successful
    samples, a sample without the key counting 0, as ``agent_loop/<name>/{mean,max}``.

    Per row (segment), as the padding sees them: ``rollout/{response_length,
    generated_tokens,prompt_length}/{mean,max,min}``, ``rollout/num_truncated`` and, with a
    ``response_length`` (the response budget), ``rollout/response_clip_fraction``:
    the rows whose response reached it (not the padded width, which the longest row always fills).

    Per trajectory, why generation stopped early (:func:`agentloop_core.stops.truncation_metrics`):
    ``rollout/truncated/{turn_cap,turn_cap_turns,context,response_budget,any}``.
    """
    ok = ~batch.failed
    last = batch.last_segment_rows()
    num_samples = len(last)
    num_failed = int(batch.failed[last].sum())
    metrics: dict[str, float] = {
        "rollout/num_samples": float(num_samples),
        "rollout/num_failed": float(num_failed),
        "rollout/failed_fraction": num_failed / num_samples,
        "rollout/num_truncated": float(batch.truncated.sum()),
    }
    lengths = [len(o.response_ids) for o, good in zip(outputs, ok, strict=True) if good]
    generated = [sum(o.response_mask) for o, good in zip(outputs, ok, strict=True) if good]
    metrics.update(_stats("rollout/response_length", lengths))
    metrics.update(_stats("rollout/generated_tokens", generated))
    metrics.update(
        _stats(
            "rollout/prompt_length", [len(o.prompt_ids) for o, good in zip(outputs, ok, strict=True) if good]
        )
    )
    finals = [(outputs[r], not batch.failed[r]) for r in last.tolist()]
    metrics.update(_stats("rollout/num_turns", [o.num_turns for o, good in finals if good]))
    if lengths and response_length is not None:
        metrics["rollout/response_clip_fraction"] = float(np.mean([n >= response_length for n in lengths]))
    metrics.update(_stats("rollout/reward", batch.rewards[last][batch.has_reward[last]].tolist()))
    segments = [float(o.segment_index + 1) for o, good in finals if good]
    if segments:
        metrics["agent_loop/num_segments/mean"] = float(np.mean(segments))
        metrics["agent_loop/num_segments/max"] = float(max(segments))

    # A trajectory reached the budget when any of its segments did; the counters live on its last one.
    longest: dict[int, int] = {}
    for t, out in zip(batch.trajectory_index.tolist(), outputs, strict=True):
        longest[t] = max(longest.get(t, 0), len(out.response_ids))
    good_last = [r for r in last.tolist() if not batch.failed[r]]
    metrics.update(truncation_metrics(
        [outputs[r].metrics for r in good_last], [longest[int(batch.trajectory_index[r])] for r in good_last],
        response_length, [bool(batch.truncated[batch.trajectory_index == batch.trajectory_index[r]].any())
                         for r in good_last]))

    timings: dict[str, list[float]] = {}
    counts: dict[str, list[float]] = {}
    n_ok = sum(good for _, good in finals)
    for o, good in finals:
        for key, value in o.metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key in STOP_METRICS:
                continue
            if key.endswith("_s"):
                timings.setdefault(key[:-2], []).append(float(value))
            elif good:
                counts.setdefault(key, []).append(float(value))
    for key in sorted(timings):
        metrics.update(_stats(f"timing_s/agent_loop/{key}", timings[key]))
    for key in sorted(counts):
        values = counts[key] + [0.0] * (n_ok - len(counts[key]))  # absent: 0
        metrics[f"agent_loop/{key}/mean"] = float(np.mean(values))
        metrics[f"agent_loop/{key}/max"] = float(max(values))
    return metrics


__all__ = ["RolloutBatch", "SequenceTooLongError", "batch_metrics", "last_segment_rows"]
