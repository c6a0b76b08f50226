"""The evaluation harness's metrics, against values computed by hand: unbiased pass@k (Chen et
al. 2021) at its edges (n = k, c = 0, c = n, k > n refused), avg@k, maj@k with its tie rule, the
standard error over problems, and the per-set grouping of a rolled-out batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from agentloop_trainer.eval import (
    Estimate,
    ProblemSamples,
    answer_extractor,
    default_ks,
    flat_metrics,
    maj_at_k,
    majority_answer,
    mean_and_se,
    pass_at_k,
    problems_by_set,
    set_metrics,
    sets_metrics,
)
from agentloop_trainer.eval.report import SetResult, format_table, to_json
from agentloop_trainer.reward.rule import extract_answer
from agentloop_trainer.reward.scoring import RewardScorer


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),                  # pass@1 = c/n
    (4, 2, 2, 1 - 1 / 6),             # 1 - C(2,2)/C(4,2)
    (5, 2, 3, 1 - 1 / 10),            # 1 - C(3,3)/C(5,3)
    (10, 3, 4, 1 - 35 / 210),         # 1 - C(7,4)/C(10,4)
    (4, 0, 4, 0.0),                   # c = 0: never
    (4, 4, 1, 1.0),                   # c = n: always
    (4, 1, 4, 1.0),                   # n = k with one correct: the k samples are all of them
    (4, 3, 2, 1.0),                   # n - c < k: every draw of 2 holds a correct one
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_form_where_floats_hold_it():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_where_binomials_overflow():
    # C(2000, 1000) overflows a float; the product form does not.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


@pytest.mark.parametrize(("n", "c", "k", "message"), [
    (4, 1, 5, "pass@5 needs at least 5 samples per problem but there are n=4; raise actor_rollout_ref.rollout.val_kwargs.n"),
    (4, 1, 0, "pass@0 needs at least 0 samples"),
    (4, 5, 1, "correct samples c=5 must be within 0..n=4"),
    (0, 0, 1, "at least one sample"),
])
def test_pass_at_k_refuses_impossible_arguments(n, c, k, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        pass_at_k(n, c, k)


def test_majority_vote_ties_go_to_the_first_answer_and_none_does_not_vote():
    assert majority_answer(["3", "4", "4", "3"]) == 0          # 2-2 tie: "3" came first
    assert majority_answer([None, None, "7", "8", "8"]) == 3   # "8" x2 beats "7"
    assert majority_answer([None, None]) is None


def test_maj_at_k_is_the_majority_answers_correctness():
    p = ProblemSamples(rewards=(0.0, 1.0, 0.0, 0.0), answers=("5", "6", "5", None))
    assert maj_at_k(p, 4) == 0.0   # "5" (2 votes, wrong) beats "6"
    assert maj_at_k(p, 2) == 0.0   # "5" vs "6": tie, "5" first
    q = ProblemSamples(rewards=(0.0, 1.0, 1.0), answers=("5", "6", "6"))
    assert maj_at_k(q, 3) == 1.0
    assert maj_at_k(ProblemSamples((0.0, 0.0), (None, None)), 2) == 0.0
    with pytest.raises(ValueError, match="maj@3 needs at least 3 samples"):
        maj_at_k(q.__class__((1.0,), ("6",)), 3)
    with pytest.raises(ValueError, match="exposes none"):
        maj_at_k(ProblemSamples((1.0,)), 1)


def test_mean_and_se_by_hand():
    # scores 1, 0, 0, 1: mean 0.5, sample variance 1/3, SE sqrt(1/12)
    est = mean_and_se([1.0, 0.0, 0.0, 1.0])
    assert est.mean == 0.5
    assert est.se == pytest.approx(math.sqrt(1 / 12))
    assert mean_and_se([0.25]) == Estimate(0.25, None)  # one problem: no error bar
    assert str(est) == "0.500 ± 0.289"
    with pytest.raises(ValueError, match="no problems"):
        mean_and_se([])


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]


def test_set_metrics_by_hand():
    problems = [
        ProblemSamples((1.0, 0.0, 0.0, 0.0), ("4", "5", "5", "6")),  # c=1: pass@1 .25, pass@2 .5, maj wrong
        ProblemSamples((1.0, 1.0, 0.0, 1.0), ("7", "7", "8", "7")),  # c=3: pass@1 .75, pass@2 1, maj right
    ]
    m = set_metrics(problems)
    assert sorted(m) == ["avg@4", "maj@4", "pass@1", "pass@2", "pass@4"]
    assert m["pass@1"].mean == pytest.approx(0.5)
    assert m["pass@1"].se == pytest.approx(0.25)           # std([.25,.75], ddof=1)=.3536 / sqrt 2
    assert m["pass@2"].mean == pytest.approx(0.75)         # (.5 + 1) / 2
    assert m["pass@4"].mean == 1.0
    assert m["pass@4"].se == 0.0
    assert m["avg@4"].mean == pytest.approx(0.5)
    assert m["maj@4"].mean == pytest.approx(0.5)
    assert "maj@1" not in set_metrics([ProblemSamples((1.0,))])  # no answers: no maj@k
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        set_metrics(problems, ks=[8])


def test_answer_extractor_follows_the_scorer():
    assert answer_extractor(RewardScorer(), "openai/gsm8k") is extract_answer
    boxed = answer_extractor(RewardScorer(), "math")
    assert boxed is not None
    assert boxed("so \\boxed{\\frac12}") == "\\frac12"
    assert answer_extractor(RewardScorer(), "my/unknown") is None       # no built-in scorer
    assert answer_extractor(RewardScorer(source="loop"), "openai/gsm8k") is None


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _batch(texts, rewards, failed):
    width = max(len(t) for t in texts)
    return SimpleNamespace(
        responses=np.array([[ord(ch) for ch in t] + [0] * (width - len(t)) for t in texts]),
        response_mask=np.array([[1] * len(t) + [0] * (width - len(t)) for t in texts]),
        trajectory_index=np.arange(len(texts)), segment_index=np.zeros(len(texts), dtype=int),
        rewards=np.array(rewards, dtype=np.float32), failed=np.array(failed),
        last_segment_rows=lambda: np.arange(len(texts)))


def test_a_batch_splits_into_sets_and_problems_with_failures_counted():
    from agentloop_trainer.rollout.rollouts import make_rows

    records = [{"prompt": [{"role": "user", "content": "q1"}], "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "4"}},
               {"prompt": [{"role": "user", "content": "q2"}], "data_source": "my/custom", "reward_model": {"ground_truth": "x"}}]
    rows = make_rows(records, 2, tag="eval")
    batch = _batch(["#### 4", "#### 1,000", "a", "b"], [1.0, 0.0, 1.0, 0.0], [False, True, False, False])
    problems = problems_by_set(rows, batch, _Tok(), RewardScorer())
    assert problems["openai/gsm8k"] == [ProblemSamples((1.0, 0.0), ("4.0", None))]  # the failed one: no answer
    assert problems["my/custom"] == [ProblemSamples((1.0, 0.0), None)]
    flat = flat_metrics(sets_metrics(problems), problems)
    assert flat["val/openai/gsm8k/pass@2"] == 1.0
    assert flat["val/openai/gsm8k/maj@2"] == 1.0
    assert flat["val/my/custom/avg@2"] == 0.5
    assert flat["val/my/custom/problems"] == 1.0
    assert "val/my/custom/maj@2" not in flat
    assert "val/my/custom/pass@1/se" not in flat


def test_table_and_json():
    metrics = set_metrics([ProblemSamples((1.0, 0.0), ("1", "2")), ProblemSamples((0.0, 0.0), ("3", "3"))])
    results = [SetResult("/ck/step_10", "openai/gsm8k", 2, 2, metrics, 1)]
    table = format_table(results)
    # maj@2: the first problem's "1"/"2" tie goes to "1" (correct), the second's "3" is wrong
    assert "step_10     openai/gsm8k  2         2  0.250 ± 0.250  0.500 ± 0.500  0.250 ± 0.250  0.500 ± 0.500  1" in table
    js = to_json(results, {"n": 2})
    assert js["results"][0]["metrics"]["pass@1"] == {"mean": 0.25, "se": 0.25}
    assert js["results"][0]["failed_samples"] == 1


def test_mlflow_takes_the_val_keys(tmp_path):
    """MLflow refuses "@" in metric names: the val keys reach it as ``_at_``."""
    from mlflow.tracking import MlflowClient

    from agentloop_trainer.config import load_config
    from agentloop_trainer.loggers import Tracking

    cfg = load_config(["trainer.logger=[mlflow]", f"trainer.mlflow_tracking_uri=sqlite:///{tmp_path / 'ml.db'}",
                       "trainer.project_name=eval-harness"])
    tracking = Tracking.from_config(cfg.trainer, tmp_path / "run", log=lambda _: None)
    tracking.log({"step": 3, "val/openai/gsm8k/pass@4": 0.5, "val/openai/gsm8k/pass@4/se": 0.125}, step=3)
    tracking.close()
    client = MlflowClient(f"sqlite:///{tmp_path / 'ml.db'}")
    experiment = client.get_experiment_by_name("eval-harness")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.metrics == {"val_openai_gsm8k_pass_at_4": 0.5, "val_openai_gsm8k_pass_at_4_se": 0.125}


def test_table_names_a_runs_hf_folder_by_its_step():
    metrics = set_metrics([ProblemSamples((1.0,))])
    table = format_table([SetResult("/runs/a/checkpoints/step_10/hf", "s", 1, 1, metrics, 0)])
    assert table.splitlines()[2].startswith("step_10/hf  s")
