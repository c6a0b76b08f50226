"""The ``agentloop eval`` table (rows: checkpoint x set) and its JSON form."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop_trainer.eval.metrics import Estimate


@dataclass(frozen=True)
class SetResult:
    """One checkpoint on one validation set."""

    checkpoint: str
    """The checkpoint folder."""
    data_source: str
    """The set (its rows' ``data_source``)."""
    problems: int
    """Problems evaluated."""
    n: int
    """Samples per problem."""
    metrics: Mapping[str, Estimate]
    """``pass@k`` for each k, ``avg@n`` and (where answers are extracted) ``maj@n``."""
    failed_samples: int
    """Samples that failed (scored 0, counted in every metric)."""


def _label(checkpoint: str) -> str:
    """A checkpoint's short name: its folder, with the parent for a run's ``.../step_10/hf``."""
    path = Path(checkpoint)
    return f"{path.parent.name}/{path.name}" if path.name == "hf" else (path.name or checkpoint)


def _cell(metrics: Mapping[str, Estimate], name: str) -> str:
    est = metrics.get(name)
    return "-" if est is None else str(est)


def format_table(results: Sequence[SetResult]) -> str:
    """Rows: checkpoint x set; columns: problems, n, pass@1, pass@n, avg@n, maj@n (each
    ``mean ± SE``), failed samples. Other k are in the JSON."""
    head = ["checkpoint", "set", "problems", "n", "pass@1", "pass@k", "avg@k", "maj@k", "failed"]
    body = [[_label(r.checkpoint), r.data_source, str(r.problems), str(r.n),
             _cell(r.metrics, "pass@1"), _cell(r.metrics, f"pass@{r.n}"), _cell(r.metrics, f"avg@{r.n}"),
             _cell(r.metrics, f"maj@{r.n}"), str(r.failed_samples)] for r in results]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(k = n, the samples per problem; ± is the standard error over problems)"


def _number(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


def to_json(results: Sequence[SetResult], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The table as a JSON object: ``date`` (UTC), ``settings`` (sampling, subset, k) and one
    entry per checkpoint x set with every metric's ``mean`` and ``se`` (null for one problem)."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": dict(settings),
        "se": "analytic standard error of the mean over problems: std(ddof=1) / sqrt(problems)",
        "results": [{"checkpoint": r.checkpoint, "data_source": r.data_source, "problems": r.problems, "n": r.n,
                     "failed_samples": r.failed_samples,
                     "metrics": {k: {"mean": _number(e.mean), "se": _number(e.se)} for k, e in r.metrics.items()}}
                    for r in results],
    }


def write_json(results: Sequence[SetResult], settings: Mapping[str, Any], out: str | Path) -> Path:
    """Write :func:`to_json` to ``out`` (its folder made); returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(results, settings), indent=2) + "\n")
    return path
