"""Rewards: the built-in scorers, a user's ``compute_score``, and how they combine with the loop's
own reward.

- :mod:`~agentloop_trainer.reward.rule`: the final ``#### N`` answer against the ground truth.
- :mod:`~agentloop_trainer.reward.answers`: the answer an instruct model wrote, in its own forms.
- :mod:`~agentloop_trainer.reward.scoring`: :class:`RewardScorer`, per ``reward.source``.
- :mod:`~agentloop_trainer.reward.limits`: a reward finite in float32 and within ``reward.timeout_s``.
- :mod:`~agentloop_trainer.reward.judge`: a model-judged reward's settings, template and parser
  (``reward.judge``); :mod:`~agentloop_trainer.reward.judge_client`: its calls and their cost;
  :mod:`~agentloop_trainer.reward.group_judge`: a GRPO group judged in one request
  (``reward.judge.mode=group``); :mod:`~agentloop_trainer.reward.rubric`: weighted criteria.
"""

from agentloop_trainer.reward.answers import (
    ANSWER_FORMS,
    MAX_SCAN_CHARS,
    MAX_STATEMENT_CHARS,
    FoundAnswer,
    answers_match,
    boxed_reward,
    find_answer,
    flexible_reward,
    leading_number,
    normalize_math_answer,
    truth_text,
)
from agentloop_trainer.reward.group_judge import GroupJudge
from agentloop_trainer.reward.judge import DEFAULT_PROMPT, PLACEHOLDERS, JudgeError, JudgeSettings
from agentloop_trainer.reward.judge_client import JudgeClient, JudgeCost, judge_step_metrics
from agentloop_trainer.reward.limits import REWARD_DTYPE, RewardTimeoutError, call_limited, not_finite_reason
from agentloop_trainer.reward.rubric import Criterion
from agentloop_trainer.reward.rule import answer_reward, extract_answer
from agentloop_trainer.reward.scoring import (
    ANSWER_FORMATS,
    BUILTIN_SCORERS,
    DEFAULT_REWARD_TIMEOUT_S,
    RewardScorer,
    answer_format_for,
    builtin_scorer,
    check_answer_format,
    load_reward_function,
    split_score,
    turn_rewards_of,
)

__all__ = [
    "ANSWER_FORMATS",
    "ANSWER_FORMS",
    "BUILTIN_SCORERS",
    "Criterion",
    "DEFAULT_PROMPT",
    "DEFAULT_REWARD_TIMEOUT_S",
    "FoundAnswer",
    "GroupJudge",
    "JudgeClient",
    "JudgeCost",
    "JudgeError",
    "JudgeSettings",
    "MAX_SCAN_CHARS",
    "MAX_STATEMENT_CHARS",
    "PLACEHOLDERS",
    "REWARD_DTYPE",
    "RewardScorer",
    "RewardTimeoutError",
    "answer_format_for",
    "answer_reward",
    "answers_match",
    "boxed_reward",
    "builtin_scorer",
    "call_limited",
    "check_answer_format",
    "extract_answer",
    "find_answer",
    "flexible_reward",
    "judge_step_metrics",
    "leading_number",
    "load_reward_function",
    "normalize_math_answer",
    "not_finite_reason",
    "split_score",
    "truth_text",
    "turn_rewards_of",
]
