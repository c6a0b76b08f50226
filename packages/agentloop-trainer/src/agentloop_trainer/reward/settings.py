"""The reward's sections: ``reward`` (its source, timeouts, answer formats and the model judge),
``custom_reward_function`` and ``reward_model.overlong_buffer`` (DAPO's over-long shaping); their
checks are :mod:`agentloop_trainer.reward.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CustomRewardFunctionSection:
    """A reward function from a Python file (verl: ``custom_reward_function``)."""

    path: str | None = None
    """Python file defining the function; null: the built-in scorer of each row's ``data_source``."""
    name: str = "compute_score"
    """Function name; signature ``(data_source, solution_str, ground_truth, extra_info)``, sync
    or async, returning a float or a dict with ``score`` (other numbers become metrics); or
    per-turn scores for ``algorithm.turn_credit``: a list (one per turn; the score is their sum)
    or a dict with ``turn_rewards`` and optionally ``score``."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the function."""


@dataclass
class RubricCriterionSection:
    """One ``reward.judge.rubric`` criterion (:mod:`agentloop_trainer.reward.rubric`)."""

    name: str = ""
    """The key the judge scores it under in its JSON reply, and the metric ``judge/<name>``: an
    identifier, not one of the cost metrics' names (calls, failures...)."""
    description: str = ""
    """What the judge reads about it."""
    weight: float = 1.0
    """Its share of the reward (> 0), relative to the other criteria's weights."""


@dataclass
class JudgeSection:
    """A model-judged reward (``reward.judge``): a model reads each finished trajectory through a
    prompt template and its reply's score becomes (part of) the reward; see
    :mod:`agentloop_trainer.reward.judge`."""

    enable: bool = False
    """Score every trajectory with the judge."""
    url: str | None = None
    """The judge: an OpenAI-compatible base URL (``http://127.0.0.1:8001/v1``, e.g. an
    ``agentloop serve``), or ``policy``: the policy's own rollout engine (in-process backends)."""
    model: str | None = None
    """The ``model`` of each chat request; null: none sent (the server's default model)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the judge's API key (never the key itself)."""
    prompt: str | None = None
    """The judge's user message: a template with ``{question}``, ``{prompt}``, ``{response}``,
    ``{ground_truth}``, ``{data_source}`` (literal braces doubled), or the path of a file holding
    one; null: a built-in 0-10 grading prompt that asks for ``Score: N``. With ``mode=group``,
    ``{responses}`` (the group's answers, numbered) and ``{n}`` stand for ``{response}``; with a
    ``rubric``, ``{criteria}`` must show the criteria. null then: a built-in prompt for that mode."""
    parser: str = "regex"
    """regex: the last match of ``pattern``'s one group | json: the value at ``json_path`` of the
    last JSON object in the reply. For one score per trajectory only: group and rubric replies
    are always JSON (see ``mode`` and ``rubric``)."""
    pattern: str = r"[Ss]core\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    """The score regex (one capturing group), for ``parser=regex``."""
    json_path: str = "score"
    """Dotted key of the score in the reply's JSON object, for ``parser=json``."""
    score_range: list[float] | None = field(default_factory=lambda: [0.0, 10.0])
    """``[low, high]``: the parsed score mapped linearly onto [0, 1] (a score outside is a failed
    judgement); null: the raw score."""
    temperature: float = 0.0
    """Judge sampling temperature (0: greedy, the same verdict for the same trajectory)."""
    max_tokens: int = 64
    """Most tokens the judge may reply with."""
    timeout_s: float = 60.0
    """Seconds one judge call may take."""
    retries: int = 2
    """Further attempts after a failed call (timeout, HTTP error, no parseable score)."""
    max_concurrency: int = 8
    """Judge calls in flight at once (per rollout worker); trajectories are judged as they finish."""
    combine: str = "replace"
    """replace: the reward is ``weight`` x the judge's score | add: the rule or custom reward
    (``reward.source``) plus ``weight`` x the judge's score."""
    weight: float = 1.0
    """Factor on the judge's score."""
    failure_score: float | None = None
    """null: a judgement that fails after the retries fails its sample, with the reason; a
    number: that judge score instead (counted in ``judge/failures`` all the same)."""
    max_response_bytes: int = 4 * 1024 * 1024
    """Most bytes read from the judge server per answer (a judge's reply is a few KB): a body
    over it, or a compressed one, fails that judgement naming this key before it is parsed."""
    mode: str = "single"
    """single: each trajectory judged on its own as it finishes | group: the trajectories of a
    GRPO group (``rollout.n`` samples of a prompt) judged together in one request once the group
    is rolled out (in the asynchronous modes of ``trainer.mode``: as soon as its last sample ends),
    each scored relative to the others (ART's RULER); needs ``rollout.n >= 2`` and a
    ``max_tokens`` that fits a score per answer. Group replies are
    JSON: ``{"scores": [s1, s2, ...]}``."""
    rubric: list[RubricCriterionSection] | None = None
    """Criteria the judge scores separately, each ``{name, description, weight}``; the reward is
    their weighted mean, each score mapped by ``score_range`` first, and each criterion's score
    is the metric ``judge/<name>``. The reply is JSON: ``{"scores": {"<name>": N, ...}}`` (group
    mode: a list of those). null: one score."""


@dataclass
class RewardSection:
    """How a trajectory's reward is put together."""

    source: str = "auto"
    """function: the reward function only | loop: the loop's own reward (tool ``calc_reward``
    and step rewards, interaction scores) | sum: both added | auto: the function when one
    applies (custom, or a built-in scorer for the row's data_source), else the loop's."""
    zero_reward_warn_steps: int = 3
    """Warn loudly when every reward has been zero for this many steps in a row (0: never); the
    first such step (or pre-RL evaluation) is reported at once too."""
    answer_format: dict[str, str] = field(default_factory=lambda: {"default": "strict"})
    """How the built-in scorers read a response's answer, per data_source (its full name or its
    tail: ``gsm8k`` covers ``openai/gsm8k``) with a ``default``: strict (only the task's canonical
    form, ``#### N`` or ``\\boxed{}``) | flexible (also "the answer is N", "answer: N",
    ``\\boxed{N}`` and the final number; the latest answer wins; commas, ``$`` and units ignored).
    Instruct models rarely write ``#### N`` unprompted: ``reward.answer_format.gsm8k=flexible``."""
    judge: JudgeSection = field(default_factory=JudgeSection)
    """A model-judged reward (off by default)."""
    timeout_s: float | None = 300.0
    """The most seconds one call of the reward function (custom or built-in) may take; past it
    the sample fails with ``RewardTimeoutError`` (counted in ``rollout/num_failed``) and the batch
    goes on. A sync function is abandoned on its own daemon thread. null: no limit."""



@dataclass
class OverlongBufferSection:
    """Over-long reward shaping (DAPO; verl: ``reward_model.overlong_buffer``): a response longer
    than ``data.max_response_length - len`` tokens gets ``-min(1, over / len) * penalty_factor``
    added to its reward, ``over`` being how far it passes that point."""

    enable: bool = False
    """Shape the rewards of over-long responses."""
    len: int = 0
    """The buffer: how many tokens before ``data.max_response_length`` the penalty starts
    (between 1 and ``data.max_response_length - 1`` when enabled)."""
    penalty_factor: float = 1.0
    """The penalty of a response that fills ``data.max_response_length`` (DAPO's 1.0)."""


@dataclass
class RewardModelSection:
    """verl's ``reward_model`` keys that agentloop reads (``reward_model.enable`` and
    ``reward_model.reward_manager`` are accepted and ignored)."""

    overlong_buffer: OverlongBufferSection = field(default_factory=OverlongBufferSection)
    """Over-long reward shaping."""



REWARD_SOURCES = ("auto", "function", "loop", "sum")
"""Values of ``reward.source``."""
