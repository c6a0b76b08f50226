"""The group judge (``reward.judge.mode=group``): a GRPO group's trajectories judged together.

GRPO only uses rewards relative to the group's mean, and a judge ranks answers it sees side
by side more consistently than it grades each on an absolute scale (the argument of ART's
RULER, "Relative Universal LLM-Elicited Rewards"). So once every trajectory of a group (the
rows sharing a ``group_id``) is rolled out, one request shows the judge the task and the
group's answers, numbered from 1, and the reply gives one score each (or, with a rubric, one
score per criterion each). That is after the rollout and before advantages: the rollout fleet
calls :meth:`GroupJudge.score` on a batch's outputs (:mod:`agentloop_trainer.rollout.rollouts`),
before dynamic sampling looks at the groups.

Trajectories that failed before judging (the loop raised; with ``combine=add``, their rule
reward failed) are not shown; a group with none left costs no request. A judgement that fails
after its retries (no reply, or one the parser cannot map onto every answer) fails every
judged sample of the group with the reason (``rollout/num_failed``; ``judge/failures`` counts
the group once), or gives each ``failure_score``: never a silent zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_trainer.reward.judge import (
    GROUP,
    JudgeSettings,
    last_json_object,
    prompt_values,
)
from agentloop_trainer.reward.judge_client import JudgeClient, JudgeCost, JudgeFailed
from agentloop_trainer.reward.limits import not_finite_reason
from agentloop_trainer.reward.rubric import map_score, rubric_score
from agentloop_trainer.reward.scoring import generated_text

logger = logging.getLogger(__name__)

Scores = list[tuple[float, dict[str, float]]]
"""Per answer, in the group's order: ``(score, {criterion: mapped score})``."""


def answers_block(responses: Sequence[str]) -> str:
    """The ``{responses}`` of a group prompt: each answer in ``<answer id="i">`` tags, from 1
    (tags, not "Answer 2:" headings, so an answer cannot pass for the next one's start)."""
    return "\n\n".join(f'<answer id="{i}">\n{text}\n</answer>' for i, text in enumerate(responses, 1))


def group_prompt(settings: JudgeSettings, row: Mapping[str, Any], responses: Sequence[str]) -> str:
    """The group's request: the template filled from the group's row (all rows of a group have
    the same prompt and ground truth) and its ``responses`` in order."""
    ground_truth = (row.get("reward_model") or {}).get("ground_truth", row.get("ground_truth"))
    values = prompt_values(row.get("raw_prompt"), "", ground_truth, row.get("data_source"))
    values.update(responses=answers_block(responses), n=str(len(responses)))
    return settings.render(values)


def parse_group_reply(reply: str, n: int, settings: JudgeSettings) -> Scores:
    """The scores of ``n`` answers in a group judge's ``reply``: its last JSON object's
    ``scores``, a list with one entry per answer in order. An entry is a number (a criterion
    mapping with a rubric), or an object with ``score`` (the criteria with a rubric); when
    every entry has an ``id`` (1..n) the ids place them, not the order.

    Raises:
        ValueError: no such list, another count than ``n``, ids that are not 1..n each once,
            or a score that is not a number in ``score_range``.
    """
    found = last_json_object(reply)
    entries = found.get("scores") if isinstance(found, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError('no JSON object with a "scores" list in the reply')
    if len(entries) != n:
        raise ValueError(f"the judge gave {len(entries)} scores for {n} answers")
    if entries and all(isinstance(e, Mapping) and "id" in e for e in entries):
        ids = [e["id"] for e in entries]
        if sorted(map(str, ids)) != sorted(str(i) for i in range(1, n + 1)):
            raise ValueError(f"the scores' ids {ids} are not the answers' 1..{n}, each once")
        entries = sorted(entries, key=lambda e: int(e["id"]))
    out: Scores = []
    for i, entry in enumerate(entries, 1):
        if settings.criteria:
            scores = entry.get("scores", entry) if isinstance(entry, Mapping) else entry
            try:
                out.append(rubric_score(scores, settings.criteria, settings.score_range))
            except ValueError as exc:
                raise ValueError(f"answer {i}: {exc}") from None
        else:
            raw = entry.get("score") if isinstance(entry, Mapping) else entry
            out.append((map_score(raw, settings.score_range, f"answer {i}'s score"), {}))
    return out


class GroupJudge:
    """Judges each group of a rolled-out batch in one request (see the module docstring).

    Args:
        client: The run's judge client (the scorer's: ``url=policy`` uses the engine it is bound to).
    """

    def __init__(self, client: JudgeClient) -> None:
        if client.settings.mode != GROUP:
            raise ValueError(f"GroupJudge needs reward.judge.mode={GROUP}, got {client.settings.mode!r}")
        self.client = client
        self.settings = client.settings

    @classmethod
    def of(cls, scorer: Any) -> GroupJudge | None:
        """The group judge of a :class:`~agentloop_trainer.reward.scoring.RewardScorer`, or None
        when it has no judge or judges trajectories one at a time."""
        client = scorer.judge_client
        return cls(client) if client is not None and client.settings.mode == GROUP else None

    async def score(self, rows: Sequence[Mapping[str, Any]], outputs: Sequence[Any], tokenizer: Any) -> int:
        """Judge every group of ``outputs`` (``trajectory_index`` indexes ``rows``; a row without
        a ``group_id`` is its own group) and set its trajectories' rewards and metrics in place.

        Returns:
            The number of judge requests made (one per group with a trajectory to judge).
        """
        trajectories: dict[int, list[Any]] = {}
        for out in outputs:
            trajectories.setdefault(int(out.trajectory_index), []).append(out)
        groups: dict[str, list[list[Any]]] = {}
        for t, segments in trajectories.items():
            key = rows[t].get("group_id")
            groups.setdefault(str(key) if key is not None else f"row-{t}", []).append(
                sorted(segments, key=lambda s: s.segment_index))
        judged = [(rows[int(members[0][0].trajectory_index)], live) for members in groups.values()
                  if (live := [segs for segs in members if not any(s.failed for s in segs)])]
        await asyncio.gather(*(self._judge_group(row, live, tokenizer) for row, live in judged))
        return len(judged)

    async def _judge_group(self, row: Mapping[str, Any], members: list[list[Any]], tokenizer: Any) -> None:
        from agentloop_core.segments import trajectory_view

        s = self.settings
        responses = [generated_text(trajectory_view(segs), tokenizer) for segs in members]
        try:
            scores, reply, cost = await self.client.judge_with(
                group_prompt(s, row, responses), tokenizer, lambda r: parse_group_reply(r, len(members), s))
        except JudgeFailed as exc:
            _put(members[0], exc.cost.metrics())
            if s.failure_score is None:
                error = f"JudgeError: group judge of {len(members)} answers: {exc}"
                logger.warning("group %s: %s", row.get("group_id"), error)
                for segs in members:
                    _put(segs, {"failed": True, "error": error})
                    for seg in segs:
                        seg.reward_score = 0.0
                return
            scores, reply = [(s.failure_score, {})] * len(members), None
        else:
            _put(members[0], cost.metrics())
        if len(members) > 1:  # a group's cost counts once, on its first trajectory
            for segs in members[1:]:
                _put(segs, JudgeCost().metrics())
        for segs, (score, parts) in zip(members, scores, strict=True):
            self._credit(segs, score, parts, reply)

    def _credit(self, segments: list[Any], score: float, parts: dict[str, float], reply: str | None) -> None:
        """Give a trajectory's segments the judged reward (``replace``: ``weight`` x score; ``add``:
        the rule reward the worker set, plus that), its metrics and the judge's reply."""
        s = self.settings
        base = 0.0 if s.combine == "replace" else float(segments[-1].reward_score or 0.0)
        reward = base + s.weight * score
        last = segments[-1]
        turns = None if s.combine == "replace" else last.extra_fields.get("turn_rewards")
        why = not_finite_reason(reward, turns)
        metrics: dict[str, Any] = {"reward/judge": score, **{f"judge/{k}": v for k, v in parts.items()}}
        if why is not None:
            metrics.update(failed=True, error=f"RewardNotFiniteError: {why} (reward.judge.weight too large?)")
            reward = 0.0
        _put(segments, metrics)
        for seg in segments:
            seg.reward_score = reward
            if s.combine == "replace":  # the loop's per-turn rewards are no part of the judge's
                seg.extra_fields.pop("turn_rewards", None)
        if reply is not None:
            last.extra_fields["judge_reply"] = reply


def _put(segments: Sequence[Any], metrics: Mapping[str, Any]) -> None:
    for seg in segments:
        seg.metrics.update(metrics)

