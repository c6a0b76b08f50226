"""``reward.judge``: the config checks, the template and score parser, and the judge client's
retries, timeouts, concurrency limit and cost against a scripted OpenAI-compatible server on
loopback (the cases a real server cannot be made to produce: 500s, stalls, chosen replies).
The real judge (``agentloop serve``) is in ``test_judge_serve.py``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.reward.judge import JudgeSettings, prompt_values, render_prompt
from agentloop_trainer.reward.judge_client import JudgeClient, JudgeFailed
from agentloop_trainer.reward.scoring import RewardScorer


class ScriptedJudge:
    """An OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1 that answers each request with
    the next scripted ``(status, reply text, delay_s)`` (the last one repeats; with ``cycle`` the
    script does), recording the requests and the most requests it had in flight at once. With
    ``reply``, each request is answered with ``reply(prompt)`` (``(status, text)``, no delay) instead,
    ``prompt`` being the request's first message."""

    def __init__(self, script: list[tuple[int, str, float]], cycle: bool = False,
                 reply: Callable[[str], tuple[int, str]] | None = None) -> None:
        self.script, self.requests, self.in_flight, self.max_in_flight = list(script), [], 0, 0
        self.cycle, self.reply = cycle, reply
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                    if judge.reply is not None:
                        status, text, delay = (*judge.reply(body["messages"][0]["content"]), 0.0)
                    else:
                        if judge.cycle:
                            judge.script.append(judge.script[0])
                        status, text, delay = judge.script.pop(0) if len(judge.script) > 1 else judge.script[0]
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                time.sleep(delay)
                with judge.lock:
                    judge.in_flight -= 1
                out = {"choices": [{"message": {"role": "assistant", "content": text}}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": 3}} if status == 200 else {"error": text}
                data = json.dumps(out).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def prompts(self) -> list[str]:
        """The first message of every request, in order."""
        return [r["body"]["messages"][0]["content"] for r in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    judges: list[ScriptedJudge] = []

    def start(*script: tuple[int, str, float], cycle: bool = False) -> ScriptedJudge:
        judges.append(ScriptedJudge(list(script), cycle=cycle))
        return judges[-1]

    yield start
    for j in judges:
        j.close()


def _settings(url: str, *overrides: str) -> JudgeSettings:
    cfg = load_config(["reward.judge.enable=true", f"reward.judge.url={url}", *overrides])
    settings = JudgeSettings.from_section(cfg.reward.judge)
    assert settings is not None
    return settings


def test_config_errors_name_the_key(tmp_path, monkeypatch):
    base = ["reward.judge.enable=true", "reward.judge.url=http://127.0.0.1:1/v1"]
    cases = {
        "reward.judge.url must be set": ["reward.judge.enable=true"],
        "reward.judge.url must be an http": ["reward.judge.enable=true", "reward.judge.url=localhost:8000"],
        "reward.judge.pattern must have exactly one capturing group": [*base, "reward.judge.pattern=score"],
        "reward.judge.pattern .* is not a regex": [*base, "reward.judge.pattern=(["],
        r"reward.judge.prompt names \['answer'\]": [*base, "reward.judge.prompt='Grade {answer}'"],
        r"put \{response\} in it": [*base, "reward.judge.prompt='Grade {question}'"],
        "neither a template .* nor an existing file": [*base, f"reward.judge.prompt={tmp_path / 'none.txt'}"],
        "reward.judge.score_range must be": [*base, "reward.judge.score_range=[10,0]"],
        "reward.judge.parser must be one of": [*base, "reward.judge.parser=xml"],
        "reward.judge.combine must be one of": [*base, "reward.judge.combine=multiply"],
        "reward.judge.max_concurrency must be at least 1": [*base, "reward.judge.max_concurrency=0"],
        "reward.judge.max_response_bytes must be an integer of at least 1024": [
            *base, "reward.judge.max_response_bytes=10"],
        "reward.judge.api_key_env names 'NO_SUCH_KEY_VAR'": [*base, "reward.judge.api_key_env=NO_SUCH_KEY_VAR"],
        "reward.judge.url=policy needs the inprocess rollout backend": [
            "reward.judge.enable=true", "reward.judge.url=policy", "actor_rollout_ref.rollout.backend=ray"],
    }
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(overrides)
    # A template file is read at load.
    template = tmp_path / "judge.txt"
    template.write_text("Q: {question}\nA: {response}\nTruth: {ground_truth}\nJSON {{\"score\": N}}")
    settings = _settings("policy", f"reward.judge.prompt={template}")
    assert settings.prompt.startswith("Q: {question}")
    assert JudgeSettings.from_section(load_config([]).reward.judge) is None  # off by default
    # The byte limit of the judge's answers reaches the client.
    limited = _settings("http://127.0.0.1:1/v1", "reward.judge.max_response_bytes=2048")
    assert JudgeClient(limited).max_response_bytes == 2048
    assert JudgeClient(_settings("http://127.0.0.1:1/v1")).max_response_bytes == 4 * 1024 * 1024


def test_template_and_parsers():
    values = prompt_values([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}], "It is 4.", 4, "x/y")
    assert values["question"] == "2+2?"
    assert values["prompt"] == "system: Be brief.\nuser: 2+2?"
    assert render_prompt("{question}|{response}|{ground_truth}|{data_source}|{{x}}", values) == "2+2?|It is 4.|4|x/y|{x}"

    regex = _settings("policy")
    assert regex.parse_score("Looks right.\nScore: 8") == pytest.approx(0.8)
    assert regex.parse_score("score = 3 ... on reflection, Score: **10**") == pytest.approx(1.0)  # the last one
    for reply, why in [("no verdict", "no match"), ("Score: 11", "outside reward.judge.score_range")]:
        with pytest.raises(ValueError, match=why):
            regex.parse_score(reply)
    js = _settings("policy", "reward.judge.parser=json", "reward.judge.json_path=verdict.score",
                   "reward.judge.score_range=null")
    assert js.parse_score('thinking {"a": 1} then {"verdict": {"score": -2.5}} done') == -2.5
    for reply in ['{"verdict": {"grade": 1}}', "no json", '{"verdict": {"score": "high"}}']:
        with pytest.raises(ValueError, match="json_path|not a number"):
            js.parse_score(reply)


def test_retries_then_a_score_and_the_cost(scripted, monkeypatch):
    judge = scripted((500, "overloaded", 0.0), (200, "no score here", 0.0), (200, "Fine. Score: 7", 0.0))
    monkeypatch.setenv("JUDGE_TEST_KEY", "k-123")
    client = JudgeClient(_settings(judge.url, "reward.judge.model=grader", "reward.judge.api_key_env=JUDGE_TEST_KEY",
                                   "reward.judge.retries=2", "reward.judge.max_tokens=9"))
    verdict = asyncio.run(client.judge("grade this", tokenizer=None))
    assert verdict.score == pytest.approx(0.7)
    assert verdict.reply == "Fine. Score: 7"
    cost = verdict.cost
    assert (cost.calls, cost.failed_calls, cost.failures) == (3, 2, 0)
    assert (cost.prompt_tokens, cost.completion_tokens) == (22, 6)  # the two 200 replies' usage
    first = judge.requests[0]
    assert first["path"] == "/v1/chat/completions"
    assert first["auth"] == "Bearer k-123"
    assert first["body"] == {"model": "grader", "messages": [{"role": "user", "content": "grade this"}],
                             "temperature": 0.0, "max_tokens": 9}


def test_a_failed_judgement_says_why(scripted):
    judge = scripted((500, "overloaded", 0.0))
    client = JudgeClient(_settings(judge.url, "reward.judge.retries=1"))
    with pytest.raises(JudgeFailed, match=r"failed after 2 attempt\(s\): RuntimeError: HTTP 500 .*overloaded") as info:
        asyncio.run(client.judge("x", tokenizer=None))
    assert (info.value.cost.calls, info.value.cost.failed_calls, info.value.cost.failures) == (2, 2, 1)

    slow = scripted((200, "Score: 5", 3.0))
    client = JudgeClient(_settings(slow.url, "reward.judge.retries=0", "reward.judge.timeout_s=0.3"))
    with pytest.raises(JudgeFailed, match="timed out after reward.judge.timeout_s=0.3"):
        asyncio.run(client.judge("x", tokenizer=None))

    vague = scripted((200, "I cannot say.", 0.0))
    client = JudgeClient(_settings(vague.url, "reward.judge.retries=0"))
    with pytest.raises(JudgeFailed, match="no match of reward.judge.pattern .*the judge replied 'I cannot say.'"):
        asyncio.run(client.judge("x", tokenizer=None))


def test_max_concurrency_bounds_the_calls_in_flight(scripted):
    judge = scripted((200, "Score: 1", 0.3))
    client = JudgeClient(_settings(judge.url, "reward.judge.max_concurrency=2"))

    async def many() -> list[float]:
        return [v.score for v in await asyncio.gather(*(client.judge(f"q{i}", None) for i in range(6)))]

    assert asyncio.run(many()) == [pytest.approx(0.1)] * 6
    assert len(judge.requests) == 6
    assert judge.max_in_flight <= 2


class _Tok:
    """Decodes ids as their characters (the scorer decodes the generated tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _output():
    from agentloop_core.output import AgentLoopOutput

    text = "The answer is 4. #### 4"
    return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[ord(c) for c in text], response_mask=[1] * len(text),
                           response_logprobs=None, num_turns=2)


ROW = {"raw_prompt": [{"role": "user", "content": "What is 2+2?"}], "data_source": "gsm8k",
       "reward_model": {"ground_truth": "4"}}


def test_scorer_combines_or_fails_the_sample(scripted):
    judge = scripted((200, "Score: 5", 0.0))
    add = RewardScorer(judge=_settings(judge.url, "reward.judge.combine=add", "reward.judge.weight=0.5"))
    out = _output()
    asyncio.run(add(out, ROW, _Tok()))
    assert out.reward_score == pytest.approx(1.0 + 0.5 * 0.5)  # the gsm8k rule's 1 + 0.5 x the judge's 0.5
    assert out.metrics["reward/function"] == 1.0
    assert out.metrics["reward/judge"] == pytest.approx(0.5)
    assert out.metrics["judge/calls"] == 1.0
    assert out.extra_fields["judge_reply"] == "Score: 5"
    sent = judge.requests[0]["body"]["messages"][0]["content"]
    assert "What is 2+2?" in sent
    assert "The answer is 4. #### 4" in sent
    assert "Reference answer:\n4" in sent
    assert add.describe("gsm8k").startswith("built-in scorer gsm8k")
    assert add.describe("gsm8k").endswith(f"+ 0.5 x the judge's score ({judge.url})")

    down = scripted((503, "down", 0.0))
    failing = RewardScorer(judge=_settings(down.url, "reward.judge.retries=1"))
    out = _output()
    asyncio.run(failing(out, ROW, _Tok()))
    assert out.failed
    assert out.metrics["error"].startswith("JudgeError: judge (http://127.0.0.1:")
    assert "HTTP 503" in out.metrics["error"]
    assert (out.metrics["judge/calls"], out.metrics["judge/failures"]) == (2.0, 1.0)  # the cost still counts

    fallback = RewardScorer(judge=_settings(down.url, "reward.judge.retries=0", "reward.judge.failure_score=0.25"))
    out = _output()
    asyncio.run(fallback(out, ROW, _Tok()))
    assert not out.failed
    assert out.reward_score == pytest.approx(0.25)  # replace: the judge's score only
    assert out.metrics["judge/failures"] == 1.0


def test_step_metrics_sum_the_cost_over_trajectories_failed_ones_too():
    from agentloop_core.batch import RolloutBatch
    from agentloop_core.output import AgentLoopOutput
    from agentloop_trainer.reward.judge_client import judge_step_metrics

    good = _output()
    good.metrics.update({"judge/calls": 1.0, "judge/prompt_tokens": 10.0, "judge/completion_tokens": 2.0,
                         "judge/seconds": 0.5, "judge/failed_calls": 0.0, "judge/failures": 0.0})
    good.reward_score = 1.0
    bad = _output()
    bad.metrics.update({"judge/calls": 3.0, "judge/prompt_tokens": 30.0, "judge/completion_tokens": 6.0,
                        "judge/seconds": 1.5, "judge/failed_calls": 3.0, "judge/failures": 1.0,
                        "failed": True, "error": "JudgeError: x"})
    outputs: list[AgentLoopOutput] = []
    for i, o in enumerate([good, bad]):
        o.trajectory_index, o.segment_index = i, 0
        outputs.append(o)
    batch = RolloutBatch.from_outputs(outputs, pad_token_id=0)
    assert batch.num_failed == 1
    metrics = judge_step_metrics(batch)
    assert metrics == {"judge/calls": 4.0, "judge/failed_calls": 3.0, "judge/prompt_tokens": 40.0,
                       "judge/completion_tokens": 8.0, "judge/seconds": 2.0, "judge/failures": 1.0}


@pytest.mark.slow
def test_failed_judgements_fail_their_samples_in_a_grpo_step(scripted, random_model_path, tmp_path):
    """Every other judge call fails with a 500 (no retries, no failure_score): those samples are
    failed with the reason and left out of the update, the others train on the judge's 0.8, and
    the step's cost counts both."""
    from agentloop_trainer.cli import main

    judge = scripted((200, "Score: 8", 0.0), (500, "judge overloaded", 0.0), cycle=True)
    out = tmp_path / "out"
    assert main([
        "train", f"model.path={random_model_path}", "trainer.total_steps=1", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8",
        "data.max_response_length=24", "data.train_size=32", "data.val_size=2", "trainer.val_before_train=false",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false", f"trainer.output_dir={out}",
        "trainer.experiment_name=half", "trainer.log_trajectories_per_step=4", "reward.judge.enable=true",
        f"reward.judge.url={judge.url}", "reward.judge.retries=0", "reward.judge.max_concurrency=1",
    ]) == 0
    steps = [json.loads(line) for line in (out / "half" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in steps if "actor/pg_loss" in m)
    assert len(judge.requests) == 4 + 2  # the step's, then the 2 held-out prompts after RL
    assert step["rollout/num_failed"] == 2
    assert (step["judge/calls"], step["judge/failures"], step["judge/failed_calls"]) == (4.0, 2.0, 2.0)
    # The judged samples' score (replace, weight 1); the failed ones have no reward.
    assert step["rollout/reward/mean"] == pytest.approx(0.8)
