"""``reward.judge.mode=group``: a GRPO group's trajectories judged together in one request.

The prompt builder and the reply parser against fixed strings; the config errors; the group
judge on rolled-out outputs against a loopback judge that scores each answer by its own text
(so a score that lands on the wrong sample shows); and GRPO steps with the group judge, against
that judge and against a real ``agentloop serve`` judge (whose tiny model writes random text:
there the plumbing is pinned, not the verdicts).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

import pytest
import test_judge_serve
from test_judge_reward import ScriptedJudge

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.reward.group_judge import GroupJudge, answers_block, group_prompt, parse_group_reply
from agentloop_trainer.reward.judge import JudgeSettings
from agentloop_trainer.reward.judge_client import JudgeClient, judge_step_metrics
from agentloop_trainer.reward.scoring import RewardScorer

KEY = test_judge_serve.KEY
served_judge = test_judge_serve.served_judge
"""The real judge: ``agentloop serve`` on loopback with the tiny random checkpoint."""

ANSWER = re.compile(r'<answer id="(\d+)">\n(.*?)\n</answer>', re.S)


def by_length(prompt: str) -> tuple[int, str]:
    """Scores each answer ``len(text) % 11`` (0-10): a score tied to the answer it belongs to."""
    return 200, json.dumps({"scores": [len(text) % 11 for _, text in ANSWER.findall(prompt)]})


@pytest.fixture
def text_judge():
    """An OpenAI-compatible judge on 127.0.0.1 whose reply is ``reply(prompt)`` (``(status,
    text)``); ``.prompts`` are the prompts it was sent."""
    judges: list[ScriptedJudge] = []

    def start(reply: Callable[[str], tuple[int, str]]) -> ScriptedJudge:
        judges.append(ScriptedJudge([], reply=reply))
        return judges[-1]

    yield start
    for j in judges:
        j.close()


def _settings(url: str, *overrides: str) -> JudgeSettings:
    settings = JudgeSettings.from_section(load_config(
        ["reward.judge.enable=true", f"reward.judge.url={url}", "reward.judge.mode=group", *overrides]).reward.judge)
    assert settings is not None
    return settings


ROW = {"raw_prompt": [{"role": "user", "content": "What is 2+2?"}], "data_source": "gsm8k",
       "reward_model": {"ground_truth": "4"}}


def test_group_prompt_numbers_every_answer_in_order():
    s = _settings("policy")
    prompt = group_prompt(s, ROW, ["four", "It is 5.\nSure."])
    assert "You are comparing 2 answers" in prompt
    assert "Question:\nWhat is 2+2?" in prompt
    assert "Reference answer:\n4" in prompt
    assert answers_block(["four", "It is 5.\nSure."]) in prompt
    assert ANSWER.findall(prompt) == [("1", "four"), ("2", "It is 5.\nSure.")]
    assert prompt.rstrip().endswith('{"scores": [s1, s2, ...]}.')
    custom = _settings("policy", "reward.judge.prompt='{n} for {question}: {responses}'")
    assert group_prompt(custom, ROW, ["a"]) == '1 for What is 2+2?: <answer id="1">\na\n</answer>'


def test_parser_reads_lists_ids_and_rubrics():
    s = _settings("policy")
    assert parse_group_reply('Thinking... {"scores": [10, 2.5, "0"]}', 3, s) == [(1.0, {}), (0.25, {}), (0.0, {})]
    # RULER-style entries with ids are placed by id, not by order; the last JSON object wins.
    reply = '{"scores": [1]} then {"scores": [{"id": 2, "score": 4}, {"id": 1, "score": 6, "why": "ok"}]}'
    assert parse_group_reply(reply, 2, s) == [(0.6, {}), (0.4, {})]
    for reply, n, why in [
        ("no json", 2, 'no JSON object with a "scores" list'),
        ('{"score": 3}', 1, 'no JSON object with a "scores" list'),
        ('{"scores": [1, 2]}', 3, "gave 2 scores for 3 answers"),
        ('{"scores": [11, 2]}', 2, "answer 1's score 11 is outside reward.judge.score_range"),
        ('{"scores": [1, true]}', 2, "answer 2's score True is not a number"),
        ('{"scores": [{"id": 1, "score": 1}, {"id": 1, "score": 2}]}', 2, "ids .* are not the answers' 1..2"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_group_reply(reply, n, s)
    rubric = _settings("policy", "reward.judge.rubric=[{name: right, description: correct, weight: 3},"
                                 "{name: brief, description: short}]")
    got = parse_group_reply('{"scores": [{"right": 10, "brief": 0}, {"scores": {"right": 0, "brief": 10}}]}', 2, rubric)
    assert got == [(pytest.approx(0.75), {"right": 1.0, "brief": 0.0}), (pytest.approx(0.25), {"right": 0.0, "brief": 1.0})]
    with pytest.raises(ValueError, match=r"answer 2: no score for criteria \['brief'\]"):
        parse_group_reply('{"scores": [{"right": 1, "brief": 2}, {"right": 3}]}', 2, rubric)


def test_config_errors_name_the_key_and_the_fix():
    base = ["reward.judge.enable=true", "reward.judge.url=http://127.0.0.1:1/v1"]
    cases = {
        "reward.judge.mode must be one of": [*base, "reward.judge.mode=pairwise"],
        r"rollout.n=1: set n to 2 or more": [*base, "reward.judge.mode=group", "actor_rollout_ref.rollout.n=1"],
        r"names \{response\}, but reward.judge.mode=group": [
            *base, "reward.judge.mode=group", "reward.judge.prompt='Grade {response}'"],
        r"put \{responses\} in it": [*base, "reward.judge.mode=group", "reward.judge.prompt='Grade {question}'"],
        r"names \['responses'\]": [*base, "reward.judge.prompt='Grade {responses} {response}'"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(overrides)
    assert load_config([*base, "reward.judge.mode=group", "actor_rollout_ref.rollout.n=2"]).reward.judge.mode == "group"
    for mode in ("one_step_off", "async"):  # each group is judged once its last sample ends
        cfg = load_config([*base, "reward.judge.mode=group", f"trainer.mode={mode}"])
        assert (cfg.reward.judge.mode, cfg.trainer.mode) == ("group", mode)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _outputs(texts_by_group: list[list[str]], failed: frozenset[int] = frozenset()):
    """Outputs of rows in groups ``g0, g1, ...``, one per text; trajectory 1 split into two segments."""
    from agentloop_core.output import AgentLoopOutput

    rows, outputs = [], []
    for g, texts in enumerate(texts_by_group):
        for text in texts:
            t = len(rows)
            rows.append({**ROW, "group_id": f"g{g}", "request_id": f"g{g}-{t}"})
            cuts = [text[: len(text) // 2], text[len(text) // 2:]] if t == 1 else [text]
            for k, part in enumerate(cuts):
                out = AgentLoopOutput(prompt_ids=[1], response_ids=[ord(c) for c in part],
                                      response_mask=[1] * len(part), response_logprobs=None, num_turns=2)
                out.trajectory_index, out.segment_index, out.reward_score = t, k, 1.0
                out.extra_fields["turn_rewards"] = [0.5, 0.5]
                if t in failed:
                    out.metrics.update(failed=True, error="ToolError: boom")
                outputs.append(out)
    return rows, outputs


def _final(outputs, t):
    return [o for o in outputs if o.trajectory_index == t][-1]


def test_one_request_per_group_and_each_score_lands_on_its_sample(text_judge):
    judge = text_judge(by_length)
    texts = [["four", "It is 4 for sure", "5"], ["The sum is 4.", "22"], ["x"]]
    rows, outputs = _outputs(texts, failed=frozenset({5}))  # the last group has only a failed sample
    scorer = RewardScorer(judge=_settings(judge.url))
    group = GroupJudge.of(scorer)
    assert group is not None
    assert asyncio.run(group.score(rows, outputs, _Tok())) == 2
    assert len(judge.prompts) == 2  # one per group; none for the group with nothing to judge
    assert sorted(len(ANSWER.findall(p)) for p in judge.prompts) == [2, 3]
    flat = [t for g in texts for t in g]
    for t, text in enumerate(flat[:5]):
        final = _final(outputs, t)
        assert final.reward_score == pytest.approx((len(text) % 11) / 10), text
        assert final.metrics["reward/judge"] == pytest.approx((len(text) % 11) / 10)
        assert "turn_rewards" not in final.extra_fields  # replace: the loop's per-turn rewards go
    # The split trajectory: both segments carry the reward; the judge saw its whole text.
    assert [o.reward_score for o in outputs if o.trajectory_index == 1] == [pytest.approx(0.5)] * 2
    assert any("It is 4 for sure" in p for p in judge.prompts)
    assert _final(outputs, 5).failed
    assert _final(outputs, 5).reward_score == 1.0  # left as it was
    # A group's cost counts once: on its first trajectory.
    assert [_final(outputs, t).metrics["judge/calls"] for t in range(5)] == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_add_keeps_the_rule_reward_and_its_turns(text_judge):
    judge = text_judge(by_length)
    rows, outputs = _outputs([["abc", "abcdefghijk"]])
    group = GroupJudge.of(RewardScorer(judge=_settings(judge.url, "reward.judge.combine=add",
                                                       "reward.judge.weight=2")))
    assert group is not None
    asyncio.run(group.score(rows, outputs, _Tok()))
    assert _final(outputs, 0).reward_score == pytest.approx(1.0 + 2 * 0.3)
    assert _final(outputs, 1).reward_score == pytest.approx(1.0 + 2 * 0.0)  # len 11 % 11
    assert _final(outputs, 0).extra_fields["turn_rewards"] == [0.5, 0.5]


def test_a_failed_group_judgement_fails_its_samples_or_scores_failure_score(text_judge):
    short = text_judge(lambda prompt: (200, '{"scores": [7]}'))  # one score for two answers
    rows, outputs = _outputs([["a", "bb"], ["ccc", "d"]])
    group = GroupJudge.of(RewardScorer(judge=_settings(short.url, "reward.judge.retries=1")))
    assert group is not None
    asyncio.run(group.score(rows, outputs, _Tok()))
    assert len(short.prompts) == 4  # 2 groups x 2 attempts
    for t in range(4):
        final = _final(outputs, t)
        assert final.failed, t
        assert final.metrics["error"].startswith("JudgeError: group judge of 2 answers: judge (http://127.0.0.1:")
        assert "gave 1 scores for 2 answers" in final.metrics["error"]
    assert [_final(outputs, t).metrics.get("judge/failures") for t in range(4)] == [1.0, None, 1.0, None]

    down = text_judge(lambda prompt: (503, "down"))
    rows, outputs = _outputs([["a", "bb"]])
    group = GroupJudge.of(RewardScorer(judge=_settings(down.url, "reward.judge.retries=0",
                                                       "reward.judge.failure_score=0.25")))
    assert group is not None
    asyncio.run(group.score(rows, outputs, _Tok()))
    assert [_final(outputs, t).reward_score for t in range(2)] == [0.25, 0.25]
    assert not any(o.failed for o in outputs)
    assert _final(outputs, 0).metrics["judge/failures"] == 1.0


def test_the_worker_scorer_leaves_the_judging_to_the_group(text_judge):
    from agentloop_core.output import AgentLoopOutput

    judge = text_judge(by_length)
    text = "#### 4"
    out = AgentLoopOutput(prompt_ids=[1], response_ids=[ord(c) for c in text], response_mask=[1] * len(text),
                          response_logprobs=None, num_turns=1)
    asyncio.run(RewardScorer(judge=_settings(judge.url))(out, ROW, _Tok()))
    assert out.reward_score == 0.0
    assert not out.failed
    asyncio.run(RewardScorer(judge=_settings(judge.url, "reward.judge.combine=add"))(out, ROW, _Tok()))
    assert out.reward_score == 1.0  # the gsm8k rule; the group judge adds its score later
    assert judge.prompts == []
    assert GroupJudge.of(RewardScorer(judge=_settings(judge.url, "reward.judge.mode=single"))) is None
    with pytest.raises(ValueError, match="needs reward.judge.mode=group"):
        GroupJudge(JudgeClient(_settings(judge.url, "reward.judge.mode=single")))


def _train(tmp_path, name: str, *overrides: str, steps: int = 2) -> list[dict]:
    from agentloop_trainer.cli import main

    out = tmp_path / "out"
    assert main([
        "train", f"trainer.total_steps={steps}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
        "data.train_size=32", "data.val_size=2", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.progress_bar=false", f"trainer.output_dir={out}",
        f"trainer.experiment_name={name}", "reward.judge.enable=true", "reward.judge.mode=group",
        "reward.judge.retries=0", *overrides,
    ]) == 0
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "actor/pg_loss" in m]


@pytest.mark.slow
def test_grpo_steps_with_a_group_judge(text_judge, random_model_path, tmp_path):
    """Each step: one judge request per group (2 prompts x 3 samples), every sample scored."""
    judge = text_judge(lambda prompt: (200, json.dumps({"scores": [10, 0, 5][: len(ANSWER.findall(prompt))]})))
    steps = _train(tmp_path, "group", f"model.path={random_model_path}", f"reward.judge.url={judge.url}")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["judge/calls"] == 2  # one per group
        assert m["rollout/num_failed"] == 0
        assert m["rollout/reward/mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3 in each group
    assert len(judge.prompts) == 2 * 2 + 2  # the steps' groups, then the 2 held-out prompts (val n=1) after RL
    assert all(len(ANSWER.findall(p)) == 3 for p in judge.prompts[:4])


@pytest.mark.slow
def test_dynamic_sampling_sees_the_group_judges_rewards(text_judge, random_model_path, tmp_path):
    """``algorithm.filter_groups`` keeps groups whose rewards differ: only the judge's scores
    differ here (the worker leaves every reward 0 for the group judge), so a kept group shows
    the judge ran before the filter."""
    judge = text_judge(lambda prompt: (200, json.dumps({"scores": [10, 0, 5][: len(ANSWER.findall(prompt))]})))
    steps = _train(tmp_path, "filtered", f"model.path={random_model_path}", f"reward.judge.url={judge.url}",
                   "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
                   "algorithm.filter_groups.max_num_gen_batches=2", steps=1)
    assert steps[0]["filter_groups/groups_kept"] == 2
    assert steps[0]["judge/calls"] == 2


def _retry_once(reply: Callable[[str], tuple[int, str]]) -> Callable[[str], tuple[int, str]]:
    """``reply``, except that the first request for each prompt (each group) gets an unparsable
    answer: the group's retry is what succeeds."""
    seen: set[str] = set()

    def answer(prompt: str) -> tuple[int, str]:
        if prompt not in seen:
            seen.add(prompt)
            return 200, "no scores here"
        return reply(prompt)

    return answer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_group_judge_in_an_asynchronous_mode(text_judge, random_model_path, tmp_path, mode):
    """In ``trainer.mode=one_step_off|async`` each group is judged once all its samples are in,
    while other groups still roll out: one judgement per trained group, each with all 3 answers,
    the retry after a bad first reply counted (``judge/calls``, ``judge/failed_calls``), no
    failure left. If a step shows fewer answers per prompt, the judge ran on part of a group;
    if no ``judge/calls``, the asynchronous driver (stages/async_driver.py) skipped the judge."""
    scores = _retry_once(lambda prompt: (200, json.dumps({"scores": [10, 0, 5][: len(ANSWER.findall(prompt))]})))
    judge = text_judge(scores)
    steps = _train(tmp_path, mode, f"model.path={random_model_path}", f"reward.judge.url={judge.url}",
                   f"trainer.mode={mode}", "reward.judge.retries=1")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["judge/calls"] == 4  # 2 groups x (a bad reply, then the retry)
        assert m["judge/failed_calls"] == 2
        assert m.get("judge/failures", 0.0) == 0.0
        assert m["rollout/num_failed"] == 0
        assert m["rollout/reward/mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3 in each group
    trained = [p for p in judge.prompts if len(ANSWER.findall(p)) > 1]
    assert len(trained) >= 2 * 2 * 2  # groups started but not trained are judged too
    assert all(len(ANSWER.findall(p)) == 3 for p in trained)


@pytest.mark.slow
def test_a_failed_group_judgement_in_async_mode_counts_each_group_once(text_judge, random_model_path, tmp_path):
    """A judge whose replies never parse: after the retries each group gets ``failure_score``,
    and ``judge/failures`` counts each trained group once, as in sync mode."""
    judge = text_judge(lambda prompt: (200, '{"scores": [7]}'))  # one score for three answers
    steps = _train(tmp_path, "async-failing", f"model.path={random_model_path}", f"reward.judge.url={judge.url}",
                   "trainer.mode=async", "reward.judge.retries=1", "reward.judge.failure_score=0.25")
    for m in steps:
        assert (m["judge/calls"], m["judge/failures"]) == (4, 2)
        assert m["rollout/num_failed"] == 0
        assert m["rollout/reward/mean"] == pytest.approx(0.25)


@pytest.mark.slow
def test_grpo_steps_with_a_served_group_judge(served_judge, random_model_path, tmp_path, monkeypatch):
    """A real judge (``agentloop serve``, the tiny model): one request per group, its usage the
    cost; its random replies rarely parse, so failure_score=0 keeps the samples and
    ``judge/failures`` counts the groups whose reply did not."""
    monkeypatch.setenv("JUDGE_KEY", KEY)
    steps = _train(tmp_path, "served", f"model.path={random_model_path}", f"reward.judge.url={served_judge}",
                   "reward.judge.model=judge", "reward.judge.api_key_env=JUDGE_KEY", "reward.judge.max_tokens=16",
                   "reward.judge.failure_score=0")
    for m in steps:
        assert m["judge/calls"] == 2
        assert m["judge/prompt_tokens"] > 0
        assert m["judge/completion_tokens"] > 0
        assert 0 <= m["judge/failures"] <= 2
        assert m["rollout/num_failed"] == 0


def test_step_metrics_count_a_group_once():
    from agentloop_core.batch import RolloutBatch

    rows, outputs = _outputs([["ab", "cd"]])
    for o in outputs:
        o.metrics.update({"judge/calls": 0.0})
    _final(outputs, 0).metrics.update({"judge/calls": 1.0, "judge/prompt_tokens": 20.0})
    batch = RolloutBatch.from_outputs(outputs, pad_token_id=0)
    metrics = judge_step_metrics(batch)
    assert (metrics["judge/calls"], metrics["judge/prompt_tokens"]) == (1.0, 20.0)

