"""Validation sets out of one rolled-out batch: the samples grouped by ``data_source`` (each
set's rows pick their scorer by it) and by problem, their answers extracted for maj@k, and the
metrics as flat ``val/<data_source>/<metric>`` keys for every logger."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from agentloop_trainer.eval.metrics import Estimate, ProblemSamples, set_metrics
from agentloop_trainer.reward.answers import find_answer, normalize_math_answer
from agentloop_trainer.reward.rule import extract_answer
from agentloop_trainer.reward.scoring import BUILTIN_SCORERS, builtin_scorer

Extractor = Callable[[str], "str | None"]


def _canonical(answer: str | None) -> str | None:
    """One spelling per answer, so "1,000", "1000" and "1000.0" vote together."""
    if answer is None:
        return None
    s = normalize_math_answer(answer)
    try:
        return repr(float(s.replace(",", "")))
    except ValueError:
        return s or None


def _found(text: str) -> str | None:
    found = find_answer(text)
    return None if found is None else found.text


def _word(text: str) -> str | None:
    said = text.rsplit("####", 1)[1].split() if "####" in text else []
    return said[0].rstrip(".").lower() if said else None


def answer_extractor(scorer: Any, data_source: str | None) -> Extractor | None:
    """How the run's reward reads an answer out of a response of ``data_source``, for maj@k;
    None when it does not say (a custom reward function, loop rewards, no built-in scorer):
    then that set has no maj@k."""
    if getattr(scorer, "path", None) is not None or getattr(scorer, "source", "auto") == "loop":
        return None
    fn = builtin_scorer(data_source, getattr(scorer, "answer_format", None))
    if fn is None:
        return None
    if fn is BUILTIN_SCORERS["openai/gsm8k"]:
        return extract_answer
    if fn is BUILTIN_SCORERS["agentloop/cards"]:
        return _word
    return _found  # \boxed{} sets and the flexible reader


def solution_texts(batch: Any, tokenizer: Any) -> dict[int, str]:
    """Per trajectory index, the text the model generated over all its segments (what the
    scorer reads: response tokens of mask 1, decoded without special tokens)."""
    tokens: dict[int, list[int]] = {}
    order = np.lexsort((np.asarray(batch.segment_index), np.asarray(batch.trajectory_index)))
    for r in order.tolist():
        mask = np.asarray(batch.response_mask[r]) == 1
        tokens.setdefault(int(batch.trajectory_index[r]), []).extend(np.asarray(batch.responses[r])[mask].tolist())
    return {t: tokenizer.decode(ids, skip_special_tokens=True) for t, ids in tokens.items()}


def problems_by_set(rows: Sequence[Mapping[str, Any]], batch: Any, tokenizer: Any,
                    scorer: Any) -> dict[str, list[ProblemSamples]]:
    """The rolled-out samples as problems (rows sharing a ``group_id``), per ``data_source``.
    A failed sample counts with reward 0 and no answer."""
    last = batch.last_segment_rows()
    traj = np.asarray(batch.trajectory_index)[last].tolist()
    rewards = dict(zip(traj, np.asarray(batch.rewards)[last].tolist(), strict=True))
    failed = dict(zip(traj, np.asarray(batch.failed, dtype=bool)[last].tolist(), strict=True))
    texts = solution_texts(batch, tokenizer)
    groups: dict[str, dict[str, list[int]]] = {}
    for t, row in enumerate(rows):
        groups.setdefault(str(row.get("data_source")), {}).setdefault(str(row["group_id"]), []).append(t)
    out: dict[str, list[ProblemSamples]] = {}
    for source, problems in groups.items():
        extract = answer_extractor(scorer, source)
        for members in problems.values():
            members.sort(key=lambda t: int(rows[t].get("rollout_n", 0)))
            answers = None if extract is None else tuple(
                None if failed.get(t, True) else _canonical(extract(texts.get(t, ""))) for t in members)
            # A trajectory the manager lost entirely is a failure: reward 0, not a dropped sample.
            out.setdefault(source, []).append(ProblemSamples(
                tuple(0.0 if failed.get(t, True) else float(rewards[t]) for t in members), answers))
    return out


def sets_metrics(problems: Mapping[str, Sequence[ProblemSamples]],
                 ks: Sequence[int] | None = None) -> dict[str, dict[str, Estimate]]:
    """Per set, :func:`~agentloop_trainer.eval.metrics.set_metrics`."""
    return {source: set_metrics(p, ks) for source, p in sorted(problems.items())}


def flat_metrics(metrics: Mapping[str, Mapping[str, Estimate]],
                 problems: Mapping[str, Sequence[ProblemSamples]], prefix: str = "val") -> dict[str, float]:
    """``{prefix}/<data_source>/<metric>`` and ``.../<metric>/se`` (absent for one problem),
    plus ``.../problems``: what every logger gets."""
    out: dict[str, float] = {}
    for source, per in metrics.items():
        for name, est in per.items():
            out[f"{prefix}/{source}/{name}"] = round(est.mean, 6)
            if est.se is not None:
                out[f"{prefix}/{source}/{name}/se"] = round(est.se, 6)
        out[f"{prefix}/{source}/problems"] = float(len(problems[source]))
    return out


def result_metrics(result: Any, tokenizer: Any, scorer: Any, prefix: str = "val") -> dict[str, float]:
    """The flat per-set metrics of an :class:`~agentloop_trainer.rollout.rollouts.EvalResult`
    (from its kept ``(rows, batch)``); empty when it kept none."""
    if getattr(result, "rollout", None) is None:
        return {}
    rows, batch = result.rollout
    problems = problems_by_set(rows, batch, tokenizer, scorer)
    return flat_metrics(sets_metrics(problems), problems, prefix)
