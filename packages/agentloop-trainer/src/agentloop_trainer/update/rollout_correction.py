"""Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection
masks for the gap between the engine's (rollout) log-probs and the trainer's recomputation of
the same policy (``old``).

Everything is computed once per batch, before the update, from ``log r = old - rollout`` per
token:

- **Importance sampling** (``rollout_is``): ``token`` weights each token by ``exp(log r)``;
  ``sequence`` weights every token of a sequence by ``exp(sum of its log r)``. The threshold
  (``rollout_is_threshold``) is a cap (``2.0``: truncated IS, TIS) or a ``"lower_upper"`` string
  (``"0.5_2.0"``: IcePop, a weight outside the bounds becomes 0; the token still counts in the
  loss's normaliser). The weights are detached.
- **Rejection** (``rollout_rs``, comma-separated options, all must pass): a token or a sequence
  whose statistic is out of bounds leaves ``response_mask`` (no loss, not in the normaliser).
  Statistics per token: ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = exp(log r) - 1 - log r``;
  ``token_kN`` per token, ``seq_sum_kN`` / ``seq_mean_kN`` / ``seq_max_kN`` over the sequence.
  The ``k1`` options take ratio bounds ``"lower_upper"`` (a single value ``u`` means ``1/u_u``)
  and keep ``log(lower) <= k1 <= log(upper)``, i.e. a ``pi_rollout / pi_old`` (product, or
  geometric mean for ``seq_mean_k1``) within the bounds, as verl does; ``k2`` / ``k3`` take an
  upper bound.

A sequence is a trajectory: the rows of one split into segments (``sequence_index``) share
their sums, means and maxima.

The levels and options are tables (:data:`IMPORTANCE_LEVELS`, :data:`REJECTION_OPTIONS`); the
config checks read their names from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from agentloop_trainer.update.tables import AlgorithmTable


@dataclass(frozen=True)
class ImportanceLevel:
    """One row of :data:`IMPORTANCE_LEVELS`: what a weight belongs to."""

    name: str
    """The value of ``algorithm.rollout_correction.rollout_is``."""
    log_weight: Callable[[Any, Any, Any], Any]
    """``(log_ratio [B, R], mask [B, R], sequence_index [B] or None) -> [B, R]`` log of each
    token's weight (before the threshold)."""


@dataclass(frozen=True)
class RejectionOption:
    """One row of :data:`REJECTION_OPTIONS`: a statistic, where it is taken and its bounds."""

    name: str
    """An option of ``algorithm.rollout_correction.rollout_rs``."""
    statistic: Callable[[Any], Any]
    """``log_ratio [B, R] -> [B, R]`` the per-token statistic (``k1``, ``k2``, ``k3``)."""
    level: Literal["token", "sum", "mean", "max"]
    """Per token, or the sequence's sum, mean or max of the statistic."""
    bounds: Literal["ratio", "upper"]
    """``ratio``: ``"lower_upper"`` ratio bounds (``u`` alone: ``1/u`` to ``u``), kept where
    ``log(lower) <= stat <= log(upper)``; ``upper``: one upper bound on the statistic."""


IMPORTANCE_LEVELS: AlgorithmTable[ImportanceLevel] = AlgorithmTable(
    "algorithm.rollout_correction.rollout_is", "agentloop.rollout_importance_levels", ImportanceLevel,
    "Add an ImportanceLevel to agentloop_trainer.update.rollout_correction.IMPORTANCE_LEVELS.")
"""Values of ``algorithm.rollout_correction.rollout_is`` (besides null)."""
REJECTION_OPTIONS: AlgorithmTable[RejectionOption] = AlgorithmTable(
    "algorithm.rollout_correction.rollout_rs option", "agentloop.rollout_rejection_options", RejectionOption,
    "Add a RejectionOption to agentloop_trainer.update.rollout_correction.REJECTION_OPTIONS.")
"""Options of ``algorithm.rollout_correction.rollout_rs`` (comma-separated; besides null)."""
SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-this before ``exp``."""


def parse_is_threshold(spec: Any) -> tuple[float | None, float]:
    """``(lower, upper)`` of ``rollout_is_threshold``: a number (or its string) is a cap,
    ``lower`` None; ``"lower_upper"`` are IcePop's bounds.

    Raises:
        ValueError: not a positive number, or ``lower > upper``.
    """
    lower, upper = _bounds(spec, "rollout_is_threshold")
    if lower is not None and lower > upper:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={spec!r}: lower bound above upper")
    return lower, upper


def parse_rs_thresholds(options: list[str], spec: Any) -> list[tuple[float | None, float]]:
    """``(lower, upper)`` per option of ``rollout_rs`` from ``rollout_rs_threshold``: one
    comma-separated entry per option, or one for all. ``k1`` options get ratio bounds (``u``
    alone: ``1/u`` to ``u``); ``k2`` / ``k3`` an upper bound, ``lower`` None.

    Raises:
        ValueError: missing, a count that matches neither, a non-positive or malformed entry, or
            ``lower_upper`` for a ``k2`` / ``k3`` option.
    """
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{key} must be set with rollout_rs (e.g. 0.5_2.0 for a k1 option, 0.01 for k2/k3)")
    entries = [part.strip() for part in str(spec).split(",") if part.strip()]
    if len(entries) == 1:
        entries = entries * len(options)
    if len(entries) != len(options):
        raise ValueError(f"{key}={spec!r} has {len(entries)} entries for {len(options)} rollout_rs options; "
                         "give one for all or one per option")
    out: list[tuple[float | None, float]] = []
    for option, entry in zip(options, entries, strict=True):
        lower, upper = _bounds(entry, "rollout_rs_threshold")
        if REJECTION_OPTIONS.get(option).bounds == "ratio":
            out.append((1.0 / upper if lower is None else lower, upper))
        elif lower is not None:
            raise ValueError(f"{key}: {option} takes one upper bound, not {entry!r}")
        else:
            out.append((None, upper))
    return out


def parse_rs_options(spec: str) -> list[str]:
    """The options of ``rollout_rs`` (comma-separated, duplicates dropped).

    Raises:
        ValueError: an unknown option, listing the valid ones.
    """
    options = list(dict.fromkeys(part.strip() for part in spec.split(",") if part.strip()))
    bad = [o for o in options if o not in REJECTION_OPTIONS]
    if bad or not options:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={spec!r}: unknown option(s) {bad}; "
                         f"valid: {', '.join(REJECTION_OPTIONS.names())} (comma-separated)")
    return options


def _bounds(spec: Any, key: str) -> tuple[float | None, float]:
    text = str(spec).strip()
    parts = text.split("_", 1) if "_" in text else [text]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"algorithm.rollout_correction.{key}={spec!r} must be a number or 'lower_upper'") from None
    if isinstance(spec, bool) or any(not v > 0 or math.isinf(v) for v in values):
        raise ValueError(f"algorithm.rollout_correction.{key}={spec!r}: bounds must be positive finite numbers")
    return (values[0], values[1]) if len(values) == 2 else (None, values[0])


@dataclass
class Correction:
    """What :func:`rollout_correction` gives the update."""

    mask: Any
    """``[B, R]`` the response mask with rejected tokens set to 0."""
    weights: Any = None
    """``[B, R]`` detached importance weights (0 off the mask), or None without ``rollout_is``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``rollout_corr/...``: ``rollout_is_mean`` (applied weights, mean over tokens),
    ``rollout_is_ratio_fraction_high`` / ``_low`` (raw weights above the cap / below its
    reciprocal or IcePop's lower bound), ``rollout_is_oob_ratio`` (IcePop: weights zeroed),
    ``rollout_rs_masked_fraction`` (tokens rejected), ``rollout_rs_seq_masked_fraction``
    (sequences with a rejected token)."""


def _per_sequence(values: Any, mask: Any, index: Any, how: str) -> Any:
    """``[B]`` each row's sequence's sum, mean or max of ``values`` over masked tokens."""
    import torch

    B = values.shape[0]
    index = torch.arange(B, device=values.device) if index is None else index.to(values.device)
    n = int(index.max()) + 1 if B else 0
    if how == "max":
        masked = values.masked_fill(mask <= 0, float("-inf")).amax(-1)
        best = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
        best = best.scatter_reduce(0, index, masked, reduce="amax")[index]
        return torch.where(torch.isinf(best), torch.zeros_like(best), best)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, index, (values * mask).sum(-1))
    if how == "sum":
        return sums[index]
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, index, mask.sum(-1))
    return (sums / counts.clamp(min=1.0))[index]


def rollout_correction(old_log_probs: Any, rollout_log_probs: Any, response_mask: Any, *,
                       rollout_is: str | None = None, rollout_is_threshold: Any = 2.0,
                       rollout_rs: str | None = None, rollout_rs_threshold: Any = None,
                       sequence_index: Any = None) -> Correction:
    """Importance weights and the rejection mask of a batch (see the module's docstring).

    Args:
        old_log_probs: ``[B, R]`` the trainer's log-probs of the policy that generated the batch.
        rollout_log_probs: ``[B, R]`` the engine's log-probs of the same tokens.
        response_mask: ``[B, R]`` 1 on generated tokens.
        rollout_is: None, ``token`` or ``sequence``.
        rollout_is_threshold: A cap, or ``"lower_upper"`` (IcePop).
        rollout_rs: None, or comma-separated options of :data:`REJECTION_OPTIONS`.
        rollout_rs_threshold: One entry for all options or one per option (comma-separated).
        sequence_index: ``[B]`` long: rows with the same value are one sequence (segments of
            a trajectory); None: each row is its own.

    Raises:
        ValueError: an unknown level or option, or a malformed threshold.
    """
    import torch

    mask = response_mask.to(torch.float32)
    log_ratio = torch.clamp((old_log_probs - rollout_log_probs).to(torch.float32) * mask, -SAFETY_BOUND, SAFETY_BOUND)
    tokens = mask.sum().clamp(min=1.0)
    rows = mask.sum(-1) > 0
    metrics: dict[str, float] = {}

    weights = None
    if rollout_is is not None:
        level = IMPORTANCE_LEVELS.find(rollout_is)
        if level is None:
            raise ValueError(f"algorithm.rollout_correction.rollout_is={rollout_is!r} must be null or one of "
                             f"{', '.join(IMPORTANCE_LEVELS.names())}")
        lower, upper = parse_is_threshold(rollout_is_threshold)
        log_w = level.log_weight(log_ratio, mask, sequence_index)
        raw = torch.exp(log_w) * mask
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            inside = (raw >= lower) & (raw <= upper)
            weights = torch.where(inside, raw, torch.zeros_like(raw))
            metrics["rollout_corr/rollout_is_oob_ratio"] = float(((~inside).float() * mask).sum() / tokens)
        weights = weights.detach()
        floor = 1.0 / upper if lower is None else lower
        metrics["rollout_corr/rollout_is_mean"] = float((weights * mask).sum() / tokens)
        metrics["rollout_corr/rollout_is_ratio_fraction_high"] = float(((raw > upper).float() * mask).sum() / tokens)
        metrics["rollout_corr/rollout_is_ratio_fraction_low"] = float(((raw < floor).float() * mask).sum() / tokens)

    keep = torch.ones_like(mask)
    if rollout_rs is not None:
        options = parse_rs_options(rollout_rs)
        for option, (lower, upper) in zip(options, parse_rs_thresholds(options, rollout_rs_threshold), strict=True):
            record = REJECTION_OPTIONS.get(option)
            stat = record.statistic(log_ratio)
            if record.level != "token":
                stat = _per_sequence(stat, mask, sequence_index, record.level).unsqueeze(-1).expand_as(mask)
            ok = stat <= upper if lower is None else (stat >= math.log(lower)) & (stat <= math.log(upper))
            keep = keep * ok.to(mask.dtype)
        rejected = (1.0 - keep) * mask
        metrics["rollout_corr/rollout_rs_masked_fraction"] = float(rejected.sum() / tokens)
        hit = (rejected.sum(-1) > 0) & rows
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(hit.sum() / rows.sum().clamp(min=1))
    new_mask = (mask * keep).to(response_mask.dtype)
    return Correction(mask=new_mask, weights=None if weights is None else weights * keep, metrics=metrics)


def _sequence_log_weight(log_ratio: Any, mask: Any, sequence_index: Any) -> Any:
    import torch

    log_w = torch.clamp(_per_sequence(log_ratio, mask, sequence_index, "sum"), -SAFETY_BOUND, SAFETY_BOUND)
    return log_w.unsqueeze(-1).expand_as(mask)


IMPORTANCE_LEVELS.add("token", ImportanceLevel("token", lambda log_ratio, mask, index: log_ratio))
IMPORTANCE_LEVELS.add("sequence", ImportanceLevel("sequence", _sequence_log_weight))


def _k1(log_ratio: Any) -> Any:
    return -log_ratio


def _k2(log_ratio: Any) -> Any:
    return 0.5 * log_ratio**2


def _k3(log_ratio: Any) -> Any:
    import torch

    return torch.exp(log_ratio) - 1.0 - log_ratio


def _builtin_rejection_options() -> list[RejectionOption]:
    """verl's options: ``token_kN``, ``seq_sum_kN``, ``seq_mean_kN`` and ``seq_max_k2/k3``."""
    statistics = {"k1": _k1, "k2": _k2, "k3": _k3}
    options: list[RejectionOption] = []
    for level in ("token", "sum", "mean", "max"):
        for k, statistic in statistics.items():
            if level == "max" and k == "k1":  # the max of -log r over a sequence is not a ratio bound
                continue
            name = f"token_{k}" if level == "token" else f"seq_{level}_{k}"
            options.append(RejectionOption(name, statistic, level, "ratio" if k == "k1" else "upper"))
    return options


for _option in _builtin_rejection_options():
    REJECTION_OPTIONS.add(_option.name, _option)
