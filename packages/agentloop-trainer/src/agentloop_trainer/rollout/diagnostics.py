"""What a run tells its user when the numbers say something is wrong: every reward zero (with a
sample response, its ground truth and the likely causes, each naming its config key), most
turns cut by the per-turn token cap, and samples that failed (a count per distinct error).

Everything here reads what the rollout already measured (rewards, the loops' ``stop/*``
counters as ``rollout/truncated/*``, tool-call counts, per-sample errors); nothing is re-run.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from agentloop_trainer.rollout.settings import RolloutSection

TURN_CAP_KEY = "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn"
"""The config key of the per-turn token cap."""
TURN_CAP_WARN_FRACTION = 0.5
"""Warn when more than this fraction of a step's turns was cut by the per-turn cap."""
_DIGITS = re.compile(r"\d+")
_SAMPLES_CHECKED = 256
"""Responses re-scored with the flexible reader to tell whether the format is the problem."""


def _responses(batch: Any, rows: Sequence[dict], tokenizer: Any) -> list[tuple[str, Any]]:
    """``(generated text, ground truth)`` of up to :data:`_SAMPLES_CHECKED` successful
    trajectories (each trajectory's last segment)."""
    out = []
    for b in batch.last_segment_rows().tolist():
        if batch.failed[b]:
            continue
        generated = batch.responses[b][batch.response_mask[b] == 1].tolist()
        text = tokenizer.decode(generated, skip_special_tokens=True)
        out.append((text, rows[int(batch.trajectory_index[b])].get("ground_truth")))
        if len(out) >= _SAMPLES_CHECKED:
            break
    return out


def _format_cause(scorer: Any, data_source: str | None, responses: list[tuple[str, Any]]) -> str:
    """The answer-format cause: what the scorer reads, and how many responses a flexible reader
    would have scored, naming the key that switches it."""
    from agentloop_trainer.reward.answers import flexible_reward
    from agentloop_trainer.reward.scoring import answer_format_for, builtin_scorer

    line = f"- answer format: data_source {data_source!r} is scored by {scorer.describe(data_source)}"
    if scorer.path is not None or scorer.source == "loop":
        return line + "; check that it reads the answer in the form the model writes it"
    if builtin_scorer(data_source) is None:
        return line
    key = f"reward.answer_format.{str(data_source).rsplit('/', 1)[-1]}"
    if answer_format_for(data_source, scorer.answer_format) == "flexible":
        return line + f" (already {key}=flexible)"
    right = sum(flexible_reward(text, truth) for text, truth in responses)
    return line + (f"; {int(right)} of {len(responses)} responses state the right answer in another form: set "
                   f"{key}=flexible to score them" if right else
                   f"; if the model answers in another form ('the answer is N'), set {key}=flexible")


def _truncation_cause(rollout: RolloutSection, response_length: int, metrics: dict[str, Any]) -> str:
    cap = rollout.multi_turn.max_tokens_per_turn
    share = metrics.get("rollout/truncated/turn_cap_turns")
    parts = []
    if share is not None:
        parts.append(f"{share:.0%} of turns cut by {TURN_CAP_KEY}={cap}")
    budget = metrics.get("rollout/truncated/response_budget")
    if budget is not None:
        parts.append(f"{budget:.0%} of samples ran out of data.max_response_length={response_length}")
    context = metrics.get("rollout/truncated/context")
    if context is not None:
        limit = rollout.max_model_len
        limit = "null, the model's own" if limit is None else limit
        parts.append(f"{context:.0%} hit the engine's context (actor_rollout_ref.rollout.max_model_len={limit})")
    return "- truncation: " + ("; ".join(parts) if parts else "not measured by this loop") + \
        " (a cut answer has no final answer to score)"


def _tool_cause(metrics: dict[str, Any]) -> str | None:
    calls = metrics.get("agent_loop/tool_calls/mean")
    if calls is None:
        return None
    if calls > 0:
        return f"- tools: {calls:.2f} tool calls per sample"
    return ("- tools: no response called a tool (agent_loop/tool_calls/mean=0): the chat template may not render the "
            "tools (some, like SmolLM2's, ignore tools=), or the model does not know the call format "
            "(actor_rollout_ref.rollout.multi_turn.tool_parser); SFT on demonstrations teaches it")


def zero_reward_hint(rows: Sequence[dict], batch: Any, tokenizer: Any, scorer: Any, when: str, *,
                     rollout: RolloutSection, response_length: int) -> str:
    """The warning for a batch whose every reward is 0.

    Args:
        rows: The rows rolled out (``batch.trajectory_index`` indexes them).
        batch: The rolled-out ``RolloutBatch`` with its rewards and metrics.
        tokenizer: Decodes the generated tokens (what the reward function saw).
        scorer: The run's :class:`~agentloop_trainer.reward.scoring.RewardScorer`.
        when: What was rolled out ("step 1", "the held-out evaluation before RL").
        rollout: The ``actor_rollout_ref.rollout`` section (its caps are named by the warning).
        response_length: ``data.max_response_length`` (named by the warning).
    """
    responses = _responses(batch, rows, tokenizer)
    sources = sorted({str(r.get("data_source")) for r in rows})
    data_source = rows[0].get("data_source") if rows else None
    lines = [f"WARNING: every reward of {when} is 0 ({batch.num_trajectories} samples, {batch.num_failed} failed), "
             f"so GRPO has nothing to learn from. data_source {sources}. Likely causes:",
             _format_cause(scorer, data_source, responses), _truncation_cause(rollout, response_length, batch.metrics)]
    tools = _tool_cause(batch.metrics)
    if tools:
        lines.append(tools)
    lines.append("- or ground truths in another form than the answers, or the wrong data_source for a built-in "
                 "scorer (set custom_reward_function.path)")
    if responses:
        text, truth = responses[0]
        lines.append(f"  a generated response (mask-1 tokens, what the reward sees): {text[-300:]!r}")
        lines.append(f"  its ground truth: {truth!r}")
    return "\n".join(lines)


def turn_cap_warning(cap: int | None, metrics: dict[str, Any], when: str) -> str | None:
    """A warning when more than :data:`TURN_CAP_WARN_FRACTION` of the turns were cut by the
    per-turn cap (``cap``: ``rollout.multi_turn.max_tokens_per_turn``), else None."""
    share = metrics.get("rollout/truncated/turn_cap_turns")
    if share is None or share <= TURN_CAP_WARN_FRACTION:
        return None
    return (f"WARNING: {share:.0%} of the turns of {when} were cut at {cap} tokens by {TURN_CAP_KEY} "
            f"({metrics.get('rollout/truncated/turn_cap', 0):.0%} of samples): the model was stopped mid-answer. "
            f"Raise {TURN_CAP_KEY} (and data.max_response_length to hold the turns)")


class RolloutWatch:
    """The trainer's checks on what each rollout measured: every reward of the run's first step
    (or of the evaluation before RL) 0, said at once; every reward 0 for
    ``reward.zero_reward_warn_steps`` steps, said again; more than half the turns of a step or
    an evaluation cut by the per-turn cap, said once.

    Args:
        tokenizer: Decodes the sample response the warnings show.
        log: Where warnings go.
        active: Whether this process warns (rank 0); the others only count.
        rollout: The ``actor_rollout_ref.rollout`` section (its per-turn cap and context).
        response_length: ``data.max_response_length``.
        zero_reward_warn_steps: ``reward.zero_reward_warn_steps`` (0: never warn).
    """

    def __init__(self, tokenizer: Any, log: Callable[[str], None], active: bool = True, *, rollout: RolloutSection,
                 response_length: int, zero_reward_warn_steps: int) -> None:
        self.tokenizer, self.log, self.active = tokenizer, log, active
        self.rollout, self.response_length = rollout, response_length
        self.zero_reward_warn_steps = zero_reward_warn_steps
        self.zero_reward_steps = 0
        """Steps in a row whose every reward was 0."""
        self._steps_seen = 0
        self._turn_cap_warned = self._eval_hinted = False

    def _turn_cap(self, metrics: dict[str, Any], when: str) -> None:
        message = None if self._turn_cap_warned else turn_cap_warning(self.rollout.multi_turn.max_tokens_per_turn, metrics, when)
        if message:
            self._turn_cap_warned = True
            self.log(message)

    def _hint(self, rows: Sequence[dict], batch: Any, scorer: Any, when: str) -> str:
        return zero_reward_hint(rows, batch, self.tokenizer, scorer, when, rollout=self.rollout,
                                response_length=self.response_length)

    def after_step(self, rows: Sequence[dict], batch: Any, rewards: Any, step: int, scorer: Any) -> None:
        """Check one training step's batch (``rewards``: one per trajectory)."""
        patience = self.zero_reward_warn_steps
        self.zero_reward_steps = self.zero_reward_steps + 1 if bool((rewards == 0).all()) else 0
        self._steps_seen += 1
        if not self.active:
            return
        self._turn_cap(batch.metrics, f"step {step}")
        first = self._steps_seen == 1 and self.zero_reward_steps == 1
        if not patience or not self.zero_reward_steps or (self.zero_reward_steps != patience and not first):
            return
        if self.zero_reward_steps == 1 and self._eval_hinted:
            self.log(f"WARNING: every reward of step {step} is 0 too (likely causes: see the warning on the held-out "
                     "evaluation before RL)")
            return
        when = f"step {step}" if self.zero_reward_steps == 1 else f"the last {patience} steps"
        self.log(self._hint(rows, batch, scorer, when))

    def after_eval(self, ev: Any, when: str, scorer: Any) -> None:
        """Check an evaluation's rollout (``EvalResult.rollout``, dropped once checked)."""
        if ev.rollout is None or not self.active:
            return
        rows, batch = ev.rollout
        ev.rollout = None
        self._turn_cap(batch.metrics, when)
        if self.zero_reward_warn_steps and not bool((batch.rewards != 0).any()):
            self._eval_hinted = True
            self.log(self._hint(rows, batch, scorer, when))


def failure_breakdown(errors: Sequence[str], limit: int = 10, width: int = 200) -> list[str]:
    """``"<count> x <error>"`` lines, most frequent first: each error's first line, cut to
    ``width`` characters; errors that differ only in their numbers (token counts, ids) count as
    one, shown by the first of them."""
    counts: Counter[str] = Counter()
    variants: dict[str, list[str]] = {}
    for e in errors:
        first = (str(e).strip().splitlines() or ["?"])[0][:width]
        key = _DIGITS.sub("N", first)
        counts[key] += 1
        seen = variants.setdefault(key, [])
        if len(seen) < 2 and first not in seen:
            seen.append(first)
    lines = []
    for key, count in counts.most_common(limit):
        alike = " (and alike, with other numbers)" if len(variants[key]) > 1 else ""
        lines.append(f"  {count} x {variants[key][0]}{alike}")
    if len(counts) > limit:
        lines.append(f"  ... and {len(counts) - limit} more distinct errors")
    return lines


def report_failures(errors: Sequence[str], total: int, command: str, out: Callable[[str], None]) -> int:
    """Print how many of ``total`` samples failed and why; returns the exit code: 1 when every
    sample failed (the numbers printed mean nothing), else 0. Errors quote tool and model text,
    so each line is :func:`~agentloop_core.console.console_safe`."""
    from agentloop_core.console import console_safe

    if not errors:
        return 0
    if len(errors) >= total:
        out(f"agentloop {command}: all {total} samples failed; the errors:")
        for line in failure_breakdown(errors):
            out(console_safe(line))
        return 1
    out(f"agentloop {command}: {len(errors)} of {total} samples failed (scored 0); the errors:")
    for line in failure_breakdown(errors):
        out(console_safe(line))
    return 0


def batch_errors(batch: Any) -> list[str]:
    """The error of each failed sample of a ``RolloutBatch`` (a failed sample is one row)."""
    return [str(m.get("error", "?")) for m, failed in zip(batch.sample_metrics, batch.failed, strict=True)
            if failed and m.get("failed")]


__all__ = ["TURN_CAP_KEY", "RolloutWatch", "batch_errors", "failure_breakdown", "report_failures", "turn_cap_warning",
           "zero_reward_hint"]
