"""Rewards: a user's ``compute_score`` (verl's signature), built-in scorers chosen by each row's
``data_source``, and the loop's own reward (tool ``calc_reward`` and step rewards, interaction
scores), put together per ``reward.source``.

:class:`RewardScorer` runs inside the rollout worker as each trajectory finishes (the worker's
``reward_fn`` hook), so scoring overlaps the trajectories still rolling out; it pickles (only
paths and names), so Ray workers load the user's file themselves.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop_trainer.reward.answers import boxed_reward, flexible_reward
from agentloop_trainer.reward.judge import JudgeSettings, prompt_values
from agentloop_trainer.reward.limits import RewardTimeoutError, call_limited, not_finite_reason
from agentloop_trainer.reward.rule import answer_reward
from agentloop_trainer.reward.settings import CustomRewardFunctionSection, RewardSection

logger = logging.getLogger(__name__)

DEFAULT_REWARD_TIMEOUT_S = 300.0
"""``reward.timeout_s`` unless set: long enough for a sandboxed test run or a remote verifier,
short enough that one stuck scorer does not hold a step for hours."""


def _gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return answer_reward(solution_str, ground_truth)


def _math(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return boxed_reward(solution_str, ground_truth)


def _flexible(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    truncated = bool(extra_info.get("truncated")) if isinstance(extra_info, Mapping) else False
    return flexible_reward(solution_str, ground_truth, truncated=truncated)


def _word(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the word after the last ``####`` is the ground truth (case and a trailing full
    stop aside): the answer of a task whose answers are names, not numbers."""
    if "####" not in solution_str:
        return 0.0
    said = solution_str.rsplit("####", 1)[1].split()
    return float(bool(said) and said[0].rstrip(".").lower() == str(ground_truth).strip().lower())


BUILTIN_SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": _gsm8k, "gsm8k": _gsm8k, "agentloop/calculator": _gsm8k, "agentloop/cards": _word,
    "lighteval/MATH": _math, "DigitalLearningGmbH/MATH-lighteval": _math, "HuggingFaceH4/MATH-500": _math,
    "math": _math, "math_dapo": _math, "aime": _math, "numina_math": _math,
}
"""``data_source`` -> scorer: ``####`` answers (GSM8K, the calculator task) and ``\\boxed{}``
answers (MATH-style sets). A data_source ending in one of these names (``my/gsm8k``) matches too."""

ANSWER_FORMATS = ("strict", "flexible")
"""Values of ``reward.answer_format``: strict reads only the task's canonical answer (``#### N``
for GSM8K and the calculator, ``\\boxed{}`` for MATH sets); flexible reads any of ``#### N``,
``\\boxed{N}``, "the answer is N" / "answer: N" and, as the last resort, the final number, the
latest answer winning (:func:`agentloop_trainer.reward.answers.find_answer`)."""

_ACCEPTS = {_gsm8k: "only '#### N'", _math: "only '\\boxed{...}'",
            _flexible: "'#### N', '\\boxed{N}', 'the answer is N' or 'answer: N', else the last number"}


def _lookup(table: Mapping[str, Any], data_source: str) -> Any:
    """``table[data_source]``, else the entry whose name's tail (after the last ``/``) is the
    data_source's tail, case-insensitive; None when neither is there."""
    if data_source in table:
        return table[data_source]
    tail = data_source.rsplit("/", 1)[-1].lower()
    for name, value in table.items():
        if tail == str(name).rsplit("/", 1)[-1].lower():
            return value
    return None


def answer_format_for(data_source: str | None, answer_format: Mapping[str, str] | str | None) -> str:
    """The ``reward.answer_format`` of a row: its data_source's entry (the full name or its tail:
    ``gsm8k`` covers ``openai/gsm8k``), else ``default``, else ``strict``."""
    if isinstance(answer_format, str):
        return answer_format
    table = dict(answer_format or {})
    found = _lookup({k: v for k, v in table.items() if k != "default"}, str(data_source)) if data_source else None
    return str(found or table.get("default") or "strict")


def check_answer_format(answer_format: Mapping[str, str] | str | None) -> None:
    """Raises ValueError naming ``reward.answer_format`` when a value is not in :data:`ANSWER_FORMATS`."""
    table = {"default": answer_format} if isinstance(answer_format, str) else dict(answer_format or {})
    bad = {k: v for k, v in table.items() if v not in ANSWER_FORMATS}
    if bad:
        raise ValueError(f"reward.answer_format values must be one of {ANSWER_FORMATS}, got {bad}; e.g. "
                         "reward.answer_format.gsm8k=flexible or reward.answer_format.default=flexible")


def builtin_scorer(data_source: str | None,
                   answer_format: Mapping[str, str] | str | None = None) -> Callable[..., float] | None:
    """The built-in scorer of ``data_source`` read with its ``answer_format`` (a mapping as
    ``reward.answer_format``, or one of :data:`ANSWER_FORMATS`; None: strict), or None when the
    data_source has no built-in scorer."""
    if not data_source:
        return None
    fn = _lookup(BUILTIN_SCORERS, str(data_source))
    if fn is None:
        return None
    return _flexible if answer_format_for(data_source, answer_format) == "flexible" else fn


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


def turn_rewards_of(result: Any, where: str) -> list[float] | None:
    """The per-turn scores in a reward function's result, or None when it gave none.

    A function may score each turn (each run of the model's tokens, in order; see
    :mod:`agentloop_trainer.update.turns`) by returning a list of numbers, one per turn (the
    score is their sum), or a dict with ``turn_rewards`` (a list) and optionally ``score``: the
    trajectory's whole score, of which the per-turn scores are parts (the rest is credited to
    the last turn; without ``score``, their sum). Only ``algorithm.turn_credit`` other than
    ``trajectory`` reads them.

    Raises:
        ValueError: naming the function when the list holds anything but finite numbers.
    """
    values = result.get("turn_rewards") if isinstance(result, Mapping) else result
    if values is None or isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (list, tuple)):
        if isinstance(result, Mapping) and values is not None:
            raise ValueError(f"{where} returned turn_rewards {values!r:.200}; give a list of numbers, one per turn")
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"{where} returned per-turn scores {values!r:.200}; each must be a finite number")
    return [float(v) for v in values]


def split_score(result: Any, where: str) -> tuple[float, dict[str, float]]:
    """A reward function's result as ``(score, extra numbers)``: a number, a dict with
    ``score`` whose other numeric values become metrics, or per-turn scores (a list, or a dict
    with ``turn_rewards``; see :func:`turn_rewards_of`) whose sum is the score unless ``score``
    says otherwise.

    Raises:
        ValueError: naming the function when the result is none of these, or not finite.
    """
    extras: dict[str, float] = {}
    turns = turn_rewards_of(result, where)
    if turns is not None and not (isinstance(result, Mapping) and "score" in result):
        if isinstance(result, Mapping):
            extras = {str(k): float(v) for k, v in result.items()
                      if isinstance(v, (bool, int, float)) and math.isfinite(float(v))}
        return math.fsum(turns), extras
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"{where} returned a dict without 'score' (keys: {sorted(result)}); return a number, "
                             "a dict with 'score', or per-turn scores (a list, or a dict with 'turn_rewards')")
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
    the last segment's messages and turns). ``extra_info`` is the row's, plus ``num_turns``,
    ``messages`` and ``truncated`` (a token limit cut the trajectory: the loops' ``stop/*``
    counters), unless the row sets them.
    """

    source: str = "auto"
    """``reward.source``: auto | function | loop | sum."""
    path: str | None = None
    """``custom_reward_function.path``; None: built-in scorers by data_source."""
    name: str = "compute_score"
    """``custom_reward_function.name``."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """``custom_reward_function.reward_kwargs``."""
    answer_format: dict[str, str] = field(default_factory=lambda: {"default": "strict"})
    """``reward.answer_format``: how the built-in scorers read answers, per data_source
    (see :data:`ANSWER_FORMATS`)."""
    judge: JudgeSettings | None = None
    """``reward.judge``: a model-judged score replacing the reward, or added to it; None: no judge."""
    timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S
    """``reward.timeout_s``: the most seconds one call of the reward function may take; past it
    the sample fails (``RewardTimeoutError``) and the batch goes on. None: no limit."""

    def __post_init__(self) -> None:
        from agentloop_trainer.reward.judge_client import JudgeClient

        check_answer_format(self.answer_format)
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(
                self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0):
            raise ValueError(f"reward.timeout_s must be a positive number of seconds or null (no limit), "
                             f"got {self.timeout_s!r}")
        self._fn: Callable[..., Any] | None = None
        self.judge_client = JudgeClient(self.judge) if self.judge is not None else None
        """Sends the judge's calls (None without a judge); ``url=policy`` needs its
        ``policy_server`` bound in this process."""

    @classmethod
    def from_sections(cls, reward: RewardSection, custom: CustomRewardFunctionSection) -> RewardScorer:
        """The scorer of the ``reward`` and ``custom_reward_function`` sections.

        Raises:
            ValueError: a wrong ``reward.judge`` key, answer format or timeout, naming it.
        """
        return cls(source=reward.source, path=custom.path, name=custom.name,
                   reward_kwargs=dict(custom.reward_kwargs or {}), answer_format=dict(reward.answer_format),
                   judge=JudgeSettings.from_section(reward.judge), timeout_s=reward.timeout_s)

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
        return builtin_scorer(data_source, self.answer_format)

    def describe(self, data_source: str | None) -> str:
        """Which reward a row of ``data_source`` gets, for the run log."""
        if self.judge is not None:
            where = "the policy engine" if self.judge.url == "policy" else self.judge.url
            group = "group " if self.judge.mode == "group" else ""
            judged = f"{self.judge.weight:g} x the {group}judge's score ({where})"
            if self.judge.combine == "replace":
                return judged
            return f"{self._describe_rule(data_source)} + {judged}"
        return self._describe_rule(data_source)

    def _describe_rule(self, data_source: str | None) -> str:
        fn = self.function_for(data_source) if self.source != "loop" else None
        what = f"{self.path}:{self.name}" if self.path else (self._describe_builtin(data_source, fn) if fn else None)
        if self.source == "loop" or (self.source == "auto" and what is None):
            return "the loop's own reward (tool calc_reward, step rewards, interaction)"
        return what + (" + the loop's own reward" if self.source == "sum" else "") if what else "nothing"

    def _describe_builtin(self, data_source: str | None, fn: Callable[..., Any]) -> str:
        fmt = answer_format_for(data_source, self.answer_format)
        return (f"built-in scorer {(_lookup(BUILTIN_SCORERS, str(data_source)) or fn).__name__.strip('_')} with "
                f"reward.answer_format {fmt} ({_ACCEPTS.get(fn, fn.__name__)})")

    async def __call__(self, output: Any, row: Mapping[str, Any], tokenizer: Any) -> None:
        try:
            if self.judge is None or (self.judge.mode == "group" and self.judge.combine == "add"):
                await self._rule(output, row, tokenizer)  # group mode: the group judge adds its score later
            elif self.judge.mode == "group":
                output.reward_score = 0.0  # the group judge's, once the group is rolled out (group_judge.py)
                _set_turn_rewards(output, None)
            elif self.judge.combine == "replace":
                await self._judged(output, row, tokenizer, 0.0)
            else:
                await self._rule(output, row, tokenizer)
                if not output.failed:
                    await self._judged(output, row, tokenizer, float(output.reward_score))
        except RewardTimeoutError as exc:
            _fail(output, row, "reward_timeout", f"RewardTimeoutError: {exc}")
            return
        if output.failed or output.reward_score is None:
            return
        why = not_finite_reason(output.reward_score, output.extra_fields.get("turn_rewards"))
        if why is not None:
            # Failed, not zeroed: one inf or NaN in a group makes all its advantages NaN.
            _fail(output, row, "reward_not_finite", f"RewardNotFiniteError: {why} (advantages are computed in "
                  "float32); return rewards within +-3.4e38, or scale them down")

    async def _judged(self, output: Any, row: Mapping[str, Any], tokenizer: Any, base: float) -> None:
        """``base`` plus the judge's weighted score; a judgement that fails marks the sample failed
        with the reason (or, with ``failure_score``, scores that), its cost counted either way."""
        from agentloop_trainer.reward.judge_client import JudgeFailed

        judge, client = self.judge, self.judge_client
        assert judge is not None, "only called with a judge"
        assert client is not None, "made with the judge"
        ground_truth = (row.get("reward_model") or {}).get("ground_truth", row.get("ground_truth"))
        values = prompt_values(row.get("raw_prompt"), generated_text(output, tokenizer), ground_truth,
                               row.get("data_source"))
        try:
            verdict = await client.judge(judge.render(values), tokenizer)
        except JudgeFailed as exc:
            output.metrics.update(exc.cost.metrics())
            if judge.failure_score is None:
                # Failed, not zero: the trainer leaves the sample out (rollout/num_failed), the
                # reason in its error; the worker keeps these metrics, so the cost still counts.
                output.metrics["failed"] = True
                output.metrics["error"] = f"JudgeError: {exc}"
                output.reward_score = 0.0
                return
            score = judge.failure_score
        else:
            output.metrics.update(verdict.cost.metrics())
            output.extra_fields["judge_reply"] = verdict.reply
            output.metrics.update({f"judge/{name}": value for name, value in verdict.parts.items()})
            score = verdict.score
        output.metrics["reward/judge"] = score
        if judge.combine == "replace":  # the loop's per-turn rewards are no part of the judge's
            _set_turn_rewards(output, None)
        output.reward_score = base + judge.weight * score

    async def _rule(self, output: Any, row: Mapping[str, Any], tokenizer: Any) -> None:
        # Here, not at the top: ``import agentloop_trainer`` (which re-exports this room) stays
        # free of agentloop_core, hence of numpy.
        from agentloop_core.stops import CONTEXT, RESPONSE_BUDGET, TURN_CAP

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
        solution = generated_text(output, tokenizer)
        ground_truth = (row.get("reward_model") or {}).get("ground_truth", row.get("ground_truth"))
        extra_info = dict(row.get("extra_info") or {})
        extra_info.setdefault("num_turns", output.num_turns)
        extra_info.setdefault("messages", output.extra_fields.get("messages"))
        # Whether a token limit cut the trajectory (the loops' stop counters): its last turn then
        # ends mid-thought, which the flexible reader must not take a last number from.
        extra_info.setdefault("truncated", any(output.metrics.get(k) for k in (TURN_CAP, CONTEXT, RESPONSE_BUDGET)))
        where = f"{self.path}:{self.name}" if self.path else f"the built-in scorer for {data_source!r}"
        # A sync scorer runs on a thread: a slow one (a sandbox, a judge call) must not stall the
        # other trajectories; and within reward.timeout_s, so a stuck one cannot hold the batch.
        result = await call_limited(fn, (data_source, solution, ground_truth, extra_info), self.reward_kwargs,
                                    timeout_s=self.timeout_s, where=f"reward function {where}")
        score, extras = split_score(result, where)
        output.metrics["reward/function"] = score
        for key, value in extras.items():
            output.metrics[f"reward/{key}"] = value
        loop_turns = output.extra_fields.get("turn_rewards") or None
        turns = turn_rewards_of(result, where)
        if self.source == "sum" and loop_reward is not None:
            output.metrics["reward/loop"] = float(loop_reward)
            score += float(loop_reward)
            turns = _add_turn_rewards(loop_turns, turns, where)
        # Per-turn rewards are parts of the final reward (agentloop_trainer.update.turns): the
        # loop's go when its reward is not part of this one.
        _set_turn_rewards(output, turns)
        output.reward_score = score


def generated_text(output: Any, tokenizer: Any) -> str:
    """The text of the tokens the model generated (mask 1), decoded without special tokens:
    what a reward function and a judge read."""
    generated = [t for t, m in zip(output.response_ids, output.response_mask, strict=True) if m == 1]
    return tokenizer.decode(generated, skip_special_tokens=True)


def _add_turn_rewards(a: list[float] | None, b: list[float] | None, where: str) -> list[float] | None:
    """The loop's and the function's per-turn rewards added turn by turn (``reward.source=sum``)."""
    if a is None or b is None:
        return a if b is None else b
    if len(a) != len(b):
        raise ValueError(f"{where} returned {len(b)} per-turn scores but the loop recorded {len(a)} turn rewards "
                         "(reward.source=sum adds them turn by turn): return one score per turn")
    return [float(x) + float(y) for x, y in zip(a, b, strict=True)]


def _fail(output: Any, row: Mapping[str, Any], counter: str, error: str) -> None:
    """Mark the sample failed with ``error`` (the trainer leaves it out: ``rollout/num_failed``,
    the reason in the step's failure breakdown) and ``metrics[counter] = 1``."""
    sample = row.get("request_id") or row.get("index")
    logger.warning("sample %s (data_source %r): %s", sample, row.get("data_source"), error)
    output.metrics[counter] = 1.0
    output.metrics["failed"] = True
    output.metrics["error"] = error
    output.reward_score = 0.0
    _set_turn_rewards(output, None)


def _set_turn_rewards(output: Any, turns: list[float] | None) -> None:
    if turns is None:
        output.extra_fields.pop("turn_rewards", None)
    else:
        output.extra_fields["turn_rewards"] = list(turns)
