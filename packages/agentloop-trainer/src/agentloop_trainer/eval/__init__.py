"""The evaluation harness: pass@k (unbiased), avg@k and maj@k with standard errors over several
validation sets (one per ``data_source``), during training (``trainer.test_freq``) and in
``agentloop eval``."""

from agentloop_trainer.eval.metrics import (
    CORRECT_AT,
    Estimate,
    ProblemSamples,
    default_ks,
    maj_at_k,
    majority_answer,
    mean_and_se,
    pass_at_k,
    set_metrics,
)
from agentloop_trainer.eval.sets import (
    answer_extractor,
    flat_metrics,
    problems_by_set,
    result_metrics,
    sets_metrics,
)

__all__ = [
    "CORRECT_AT",
    "Estimate",
    "ProblemSamples",
    "answer_extractor",
    "default_ks",
    "flat_metrics",
    "maj_at_k",
    "majority_answer",
    "mean_and_se",
    "pass_at_k",
    "problems_by_set",
    "result_metrics",
    "set_metrics",
    "sets_metrics",
]
