"""The shipped environments (``number_guess``, ``calculator``) through ``agentloop data env`` and
a 3-step ``agentloop train``: the exact command lines of the trainer README's Environments
section, with a small random model as ``$CKPT``."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from agentloop_trainer.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[list[str]]:
    """The ``agentloop`` lines of the README block marked ``env-runs``, split as a shell would."""
    text = README.read_text()
    block = re.search(r"<!-- env-runs:.*?-->\n```bash\n(.*?)```", text, re.S)
    assert block, f"{README} lost its env-runs block"
    return [shlex.split(line)[1:] for line in block.group(1).splitlines() if line.startswith("agentloop ")]


def test_the_readme_has_a_data_and_a_train_line_per_environment():
    commands = readme_commands()
    assert [c[:3] for c in commands if c[0] == "data"] == [["data", "env", "number_guess"], ["data", "env", "calculator"]]
    assert sum(c[0] == "train" and "trainer.total_steps=3" in c for c in commands) == 2


@pytest.mark.parametrize("environment", ["number_guess", "calculator"])
def test_three_step_train_on_a_shipped_environment(environment, random_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = [c for c in readme_commands() if any(environment in a for a in c)]
    assert len(commands) == 2
    for command in commands:
        args = [a.replace("$CKPT", str(random_model_path)) for a in command]
        assert main(args) == 0, args
    name = next(a.split("=", 1)[1] for a in commands[1] if a.startswith("trainer.experiment_name="))
    run = tmp_path / "outputs" / name
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2, 3]
    for s in train:
        assert s["rollout/num_failed"] == 0, s
        # The env_agent loop ran and its reward was the one used (a random model's turns are
        # cut by max_tokens_per_turn, so few are stepped: test_env_on_hf_server steps them).
        assert "agent_loop/env_steps/mean" in s, sorted(s)
        assert "agent_loop/reward/loop/mean" in s, sorted(s)
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


def test_env_on_hf_server_keeps_the_engine_tokens(random_model_path, tokenizer):
    """The number_guess environment under env_agent on a real HFServer: every turn stepped
    (each token ends a turn), the mask-1 tokens exactly the engine's, the feedback mask 0."""
    import asyncio

    from agentloop_engines.adapters.hf import HFServer
    from agentloop_tools.env_agent import EnvAgentLoop
    from agentloop_trainer.task.number_guess import number_guess_rows

    async def go():
        server = HFServer(str(random_model_path), max_model_len=512)
        try:
            row = number_guess_rows(1, 3, "test")[0]
            loop = EnvAgentLoop(server, tokenizer, {"response_length": 200, "max_assistant_turns": 4})
            # Any token ends a turn, so a random model's turns end cleanly and are stepped.
            sampling = {"temperature": 1.0, "max_tokens": 4, "logprobs": True, "seed": 0,
                        "stop_token_ids": list(range(len(tokenizer)))}
            return await loop.run(sampling, raw_prompt=row["prompt"], extra_info=row["extra_info"], request_id="g")
        finally:
            await server.close()

    out = asyncio.run(go())
    assert out.metrics["env_steps"] == out.metrics["assistant_turns"] - (out.extra_fields["termination_reason"]
                                                                         == "max_assistant_turns")
    assert out.metrics["env_steps"] >= 3
    assert len(out.extra_fields["step_rewards"]) == out.metrics["env_steps"]
    assert out.reward_score == pytest.approx(sum(out.extra_fields["step_rewards"]))
    generated = [m for m in out.extra_fields["messages"] if m["role"] == "assistant"]
    assert len(generated) == out.metrics["assistant_turns"]
    masked = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m]
    assert any(hint in tokenizer.decode(masked) for hint in ("Higher.", "Lower.", "Reply with one whole number"))
    assert len(out.response_logprobs) == len(out.response_ids)


def test_the_env_agent_section_reaches_the_loop_config(tmp_path):
    from agentloop_trainer.config import load_config
    from agentloop_trainer.stages.rollout_setup import rollout_config

    base = ["actor_rollout_ref.rollout.multi_turn.max_tool_response_tokens=40"]
    cfg = load_config([*base, "actor_rollout_ref.rollout.agent.loops.env_agent.environment=number_guess",
                       "actor_rollout_ref.rollout.agent.loops.env_agent.environment_kwargs.max_guesses=3"])
    settings = dict(rollout_config(cfg).agent_loop_configs)["env_agent"]
    assert settings.environment == "number_guess"
    assert dict(settings.environment_kwargs) == {"max_guesses": 3}
    assert settings.max_tool_response_tokens == 40  # the tool loops' keys reach env_agent too
    cfg = load_config([*base, "actor_rollout_ref.rollout.agent.loops.env_agent.enviroment=number_guess"])
    with pytest.raises(ValueError, match=r"env_agent config has unknown keys 'enviroment' \(did you mean 'environment'\?\)"):
        rollout_config(cfg)
