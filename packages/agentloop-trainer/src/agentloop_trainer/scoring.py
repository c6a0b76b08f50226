"""Rewards: a user's ``compute_score`` (verl's signature), built-in scorers chosen by each row's
``data_source``, and the loop's own reward (tool ``calc_reward`` and step rewards, interaction
scores), put together per ``reward.source``.

:class:`RewardScorer` runs inside the rollout worker as each trajectory finishes (the worker's
``reward_fn`` hook), so scoring overlaps the trajectories still rolling out; it pickles (only
paths and names), so Ray workers load the user's file themselves.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop_trainer.reward import answer_reward


def _balanced_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed"):].strip()  # "\boxed 5"
        return rest.split()[0] if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


_STRIP = [(r"\\left|\\right|\\!|\\,|\\;|\\:|\\\$|\$", ""), (r"\\[dt]frac", r"\\frac"), (r"\^\{\\circ\}|\^\\circ", ""),
          (r"\\text\{\s*([^}]*)\}", r"\1"), (r"\\mbox\{\s*([^}]*)\}", r"\1"), (r"\s+", "")]


def normalize_math_answer(answer: str) -> str:
    """A MATH answer in a canonical spelling: no spacing commands, ``\\dfrac`` -> ``\\frac``,
    no ``\\text{}`` wrappers or dollar signs, no trailing period, no whitespace."""
    s = answer.strip()
    for pattern, repl in _STRIP:
        s = re.sub(pattern, repl, s)
    s = s.rstrip(".")
    s = re.sub(r"^([a-zA-Z]\w*)=", "", s)  # "x=5" -> "5"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # "\frac12" -> "\frac{1}{2}"
    return s


def _as_number(s: str) -> float | None:
    m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    try:
        if m:
            return float(m.group(1)) / float(m.group(2))
        if re.fullmatch(r"-?[\d,]*\.?\d+(/\d+)?%?", s):
            s = s.replace(",", "").rstrip("%")
            if "/" in s:
                a, b = s.split("/")
                return float(a) / float(b)
            return float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def boxed_reward(solution_text: str, ground_truth: Any) -> float:
    """1.0 when the last ``\\boxed{}`` answer equals ``ground_truth`` (itself boxed or plain)
    after normalisation, or numerically; else 0.0."""
    predicted = _balanced_boxed(solution_text)
    if predicted is None:
        return 0.0
    truth = str(ground_truth)
    truth = _balanced_boxed(truth) or truth
    a, b = normalize_math_answer(predicted), normalize_math_answer(truth)
    if a == b:
        return 1.0
    x, y = _as_number(a), _as_number(b)
    return 1.0 if x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) else 0.0


def _gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return answer_reward(solution_str, ground_truth)


def _math(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return boxed_reward(solution_str, ground_truth)


BUILTIN_SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": _gsm8k, "gsm8k": _gsm8k, "agentloop/calculator": _gsm8k,
    "lighteval/MATH": _math, "DigitalLearningGmbH/MATH-lighteval": _math, "HuggingFaceH4/MATH-500": _math,
    "math": _math, "math_dapo": _math, "aime": _math, "numina_math": _math,
}
"""``data_source`` -> scorer: ``####`` answers (GSM8K, the calculator task) and ``\\boxed{}``
answers (MATH-style sets). A data_source ending in one of these names (``my/gsm8k``) matches too."""


def builtin_scorer(data_source: str | None) -> Callable[..., float] | None:
    """The built-in scorer of ``data_source``, or None."""
    if not data_source:
        return None
    if data_source in BUILTIN_SCORERS:
        return BUILTIN_SCORERS[data_source]
    tail = str(data_source).rsplit("/", 1)[-1].lower()
    for name, fn in BUILTIN_SCORERS.items():
        if tail == name.rsplit("/", 1)[-1].lower():
            return fn
    return None


def load_reward_function(path: str | Path, name: str = "compute_score",
                         reward_kwargs: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Import ``name`` from the Python file at ``path`` and check it takes verl's four
    arguments plus ``reward_kwargs``.

    Raises:
        FileNotFoundError: naming the path and the config key.
        ValueError: the file has no such callable, or it cannot take verl's four arguments.
    """
    from agentloop_core.imports import import_file

    path = Path(path).expanduser().resolve()
    module = import_file(path, "custom_reward_function.path", prefix="agentloop_reward")
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"{path} has no function {name!r} (custom_reward_function.name); callables there: {found}")
    try:
        inspect.signature(fn).bind("data_source", "solution", "truth", {}, **dict(reward_kwargs or {}))
    except TypeError as exc:
        raise ValueError(f"{path}:{name} must accept (data_source, solution_str, ground_truth, extra_info) plus "
                         f"custom_reward_function.reward_kwargs {sorted(reward_kwargs or {})}: {exc}") from None
    return fn


def split_score(result: Any, where: str) -> tuple[float, dict[str, float]]:
    """A reward function's result as ``(score, extra numbers)``: a number, or a dict with
    ``score`` whose other numeric values become metrics.

    Raises:
        ValueError: naming the function when the result is neither, or not finite.
    """
    extras: dict[str, float] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"{where} returned a dict without 'score' (keys: {sorted(result)})")
        extras = {str(k): float(v) for k, v in result.items()
                  if k != "score" and isinstance(v, (bool, int, float)) and math.isfinite(float(v))}
        result = result["score"]
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(float(result)):
        raise ValueError(f"{where} returned {result!r}; return a finite number or a dict with 'score'")
    return float(result), extras


@dataclass
class RewardScorer:
    """Scores one finished trajectory (the rollout worker's ``reward_fn``).

    ``solution_str`` is the text of the tokens the model generated (mask 1), decoded without
    special tokens: tool results and user turns are not part of it, so a tool cannot answer
    for the model. A trajectory split into segments is scored once, on all of them
    (``agentloop_core.segments.trajectory_view``: every segment's generated tokens in order,
    the last segment's messages and turns).
    """

    source: str = "auto"
    """``reward.source``: auto | function | loop | sum."""
    path: str | None = None
    """``custom_reward_function.path``; None: built-in scorers by data_source."""
    name: str = "compute_score"
    """``custom_reward_function.name``."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """``custom_reward_function.reward_kwargs``."""

    def __post_init__(self) -> None:
        self._fn: Callable[..., Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_fn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fn = None

    def function_for(self, data_source: str | None) -> Callable[..., Any] | None:
        """The reward function for a row: the custom one, else the data_source's built-in."""
        if self.path is not None:
            if self._fn is None:
                self._fn = load_reward_function(self.path, self.name, self.reward_kwargs)
            return self._fn
        return builtin_scorer(data_source)

    def describe(self, data_source: str | None) -> str:
        """Which reward a row of ``data_source`` gets, for the run log."""
        fn = self.function_for(data_source) if self.source != "loop" else None
        what = f"{self.path}:{self.name}" if self.path else (f"built-in scorer {fn.__name__.strip('_')}" if fn else None)
        if self.source == "loop" or (self.source == "auto" and what is None):
            return "the loop's own reward (tool calc_reward, step rewards, interaction)"
        return what + (" + the loop's own reward" if self.source == "sum" else "") if what else "nothing"

    async def __call__(self, output: Any, row: Mapping[str, Any], tokenizer: Any) -> None:
        data_source = row.get("data_source")
        loop_reward = output.reward_score
        fn = None if self.source == "loop" else self.function_for(data_source)
        if fn is None:
            if self.source in ("function", "sum"):
                raise ValueError(f"no reward function for data_source {data_source!r}: set "
                                 "custom_reward_function.path, or use one of the built-in data sources "
                                 f"{sorted(BUILTIN_SCORERS)}")
            if loop_reward is None:
                raise ValueError(f"no reward for data_source {data_source!r}: the loop returned none and there is "
                                 "no reward function; set custom_reward_function.path, use a built-in data_source "
                                 f"({sorted(BUILTIN_SCORERS)}), or give the tools a calc_reward")
            output.metrics["reward/loop"] = float(loop_reward)
            return
        generated = [t for t, m in zip(output.response_ids, output.response_mask, strict=True) if m == 1]
        solution = tokenizer.decode(generated, skip_special_tokens=True)
        ground_truth = (row.get("reward_model") or {}).get("ground_truth", row.get("ground_truth"))
        extra_info = dict(row.get("extra_info") or {})
        extra_info.setdefault("num_turns", output.num_turns)
        extra_info.setdefault("messages", output.extra_fields.get("messages"))
        where = f"{self.path}:{self.name}" if self.path else f"the built-in scorer for {data_source!r}"
        if inspect.iscoroutinefunction(fn):
            result = await fn(data_source, solution, ground_truth, extra_info, **self.reward_kwargs)
        else:
            # A thread: a slow scorer (a sandbox, a judge call) must not stall the other trajectories.
            result = await asyncio.to_thread(fn, data_source, solution, ground_truth, extra_info, **self.reward_kwargs)
            if inspect.isawaitable(result):
                result = await result
        score, extras = split_score(result, where)
        output.metrics["reward/function"] = score
        for key, value in extras.items():
            output.metrics[f"reward/{key}"] = value
        if self.source == "sum" and loop_reward is not None:
            output.metrics["reward/loop"] = float(loop_reward)
            score += float(loop_reward)
        output.reward_score = score
