"""``model.custom_chat_template``: it reaches every tokenizer a run loads (trainer, eval,
rollout, Ray workers, engines, exported folders, ``agentloop serve --chat-template``), and a run
whose template ignores its tools fails at start-up with exit code 2 and the key to set.

The checkpoint under test is the tiny tokenizer saved with a plain ChatML template that never
reads ``tools`` (as SmolLM2-135M-Instruct's), so the failure and the fix are those of a real
instruct checkpoint without its 538 MB of weights.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from agentloop_core.tokenization import resolve_chat_template
from agentloop_trainer.cli import main
from agentloop_trainer.config import ConfigError, load_config

PLAIN_CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""ChatML that never reads ``tools`` (SmolLM2's template, without its default system prompt)."""

HERMES = resolve_chat_template("chatml-hermes")
FAST = ["data.val_size=2", "data.train_size=8", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=32"]


def _plain_tokenizer():
    from agentloop_core.testing import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    tok.chat_template = PLAIN_CHATML
    return tok


@pytest.fixture
def tokenizer_folder(tmp_path):
    """A checkpoint folder with config.json and the plain-template tokenizer, no weights: what a
    check that runs before the model loads needs."""
    folder = tmp_path / "plain-tokenizer"
    _plain_tokenizer().save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


@pytest.fixture(scope="module")
def plain_model(random_model_path, tmp_path_factory):
    """The random tiny policy with the plain-template tokenizer."""
    folder = tmp_path_factory.mktemp("plain-model") / "ckpt"
    shutil.copytree(random_model_path, folder)
    for stale in ("chat_template.jinja", "tokenizer_config.json"):
        (folder / stale).unlink(missing_ok=True)
    _plain_tokenizer().save_pretrained(folder)
    return folder


def test_the_key_its_verl_spelling_and_unknown_names():
    assert load_config(["model.custom_chat_template=chatml-hermes"]).model.custom_chat_template == "chatml-hermes"
    verl = load_config(["actor_rollout_ref.model.custom_chat_template=llama3-json"])
    assert verl.model.custom_chat_template == "llama3-json"
    assert load_config().model.custom_chat_template is None
    with pytest.raises(ConfigError, match=r"model.custom_chat_template: unknown chat template 'chatml-hermis' "
                                          r"\(did you mean 'chatml-hermes'\?\).*a path to a Jinja file"):
        load_config(["model.custom_chat_template=chatml-hermis"])


def test_the_key_reaches_every_tokenizer_and_setting_of_the_run(tokenizer_folder, tmp_path):
    from agentloop_core.runtime import AgentLoopWorker
    from agentloop_core.testing import ScriptedServer
    from agentloop_trainer.cli.evaluate import _tokenizer
    from agentloop_trainer.policy import TemplateIgnoresToolsError, load_tokenizer
    from agentloop_trainer.stages import load_policy_tokenizer
    from agentloop_trainer.stages.rollout_setup import engine_config, rollout_config
    from agentloop_trainer.stages.sft.warmup_checkpoint import sft_cache_key

    plain, fixed = load_config(), load_config(["model.custom_chat_template=chatml-hermes"])
    assert load_policy_tokenizer(plain, tokenizer_folder).chat_template == PLAIN_CHATML
    assert load_policy_tokenizer(fixed, tokenizer_folder).chat_template == HERMES  # trainer (and FSDP ranks)
    assert _tokenizer(fixed, tokenizer_folder).chat_template == HERMES  # agentloop eval / rollout
    assert load_tokenizer(fixed.model).chat_template == HERMES  # the tiny tokenizer of the SFT warm-up
    assert sft_cache_key(fixed) != sft_cache_key(plain)  # its demonstrations render differently
    with pytest.raises(TemplateIgnoresToolsError, match="model.custom_chat_template=chatml-hermes"):
        _tokenizer(plain, tokenizer_folder)
    # What loads the tokenizer by path gets the template text with it.
    assert rollout_config(fixed).custom_chat_template == HERMES
    assert rollout_config(plain).custom_chat_template is None
    worker = AgentLoopWorker(ScriptedServer(), str(tokenizer_folder), {"custom_chat_template": HERMES})
    assert worker.tokenizer.chat_template == HERMES  # a Ray rollout worker
    assert engine_config(fixed, str(tokenizer_folder)).chat_template == HERMES  # a Ray engine replica
    path = tmp_path / "mine.jinja"
    path.write_text(HERMES.replace("You can call functions", "Call functions"))
    assert "Call functions" in load_policy_tokenizer(load_config([f"model.custom_chat_template={path}"]),
                                                     tokenizer_folder).chat_template


@pytest.mark.parametrize("command", ["train", "eval", "rollout"])
def test_a_template_that_ignores_the_tools_fails_at_start_up_with_exit_2(command, tokenizer_folder, tmp_path,
                                                                         capsys):
    run_dir = tmp_path / "run"
    if command == "train":
        argv = ["train", f"model.path={tokenizer_folder}", f"trainer.run_dir={run_dir}", *FAST]
    else:
        argv = [command, str(tokenizer_folder), *FAST]
        if command == "rollout":
            argv.append(f"--out={tmp_path / 'r.jsonl'}")
    # The folder has no weights: reaching the model (or the pre-RL eval) would fail otherwise.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"agentloop {command}: the chat template of {tokenizer_folder} ignores tools=" in err
    assert "model.custom_chat_template=chatml-hermes" in err
    assert "['calculator']" in err
    assert not run_dir.exists()
    assert not (tmp_path / "r.jsonl").exists()


def test_with_the_key_the_rollout_shows_the_tools_to_the_model(plain_model, tmp_path):
    from agentloop_trainer.cli import write_rollouts

    cfg = load_config(["model.custom_chat_template=chatml-hermes", *FAST])
    out = write_rollouts(cfg, plain_model, tmp_path / "r.jsonl", num_prompts=1)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    from agentloop_core.testing import load_tiny_tokenizer

    prompt = load_tiny_tokenizer().decode(records[0]["prompt_ids"])
    assert not records[0]["failed"], records[0]["metrics"].get("error")
    assert "<tools>" in prompt
    assert '"name": "calculator"' in prompt


def test_the_exported_hf_folder_carries_the_runs_template(plain_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop_trainer.checkpoint import write_hf_folder
    from agentloop_trainer.policy import load_tokenizer

    tokenizer = load_tokenizer(load_config(["model.custom_chat_template=chatml-hermes"]).model, plain_model)
    model = AutoModelForCausalLM.from_pretrained(plain_model)
    write_hf_folder(model, tokenizer, tmp_path / "hf", max_shard_bytes=1 << 30)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == HERMES
    # So `agentloop eval` of the export needs no key.
    from agentloop_trainer.cli.evaluate import _tokenizer

    assert _tokenizer(load_config(), tmp_path / "hf").chat_template == HERMES


@pytest.mark.parametrize("flag", [True, False])
def test_serve_chat_template_flag(flag, plain_model, monkeypatch):
    import agentloop_engines.serving.server as http_server

    served = {}
    monkeypatch.setattr(http_server, "serve", lambda engine, *a, gateway=None, **k: served.update(gateway=gateway,
                                                                                                   engine=engine))
    argv = ["serve", str(plain_model), "--port=0"] + (["--chat-template", "chatml-hermes"] if flag else [])
    assert main(argv) == 0
    gateway = served["gateway"]
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]}

    async def ask():
        try:
            return await gateway.chat_completion(body)
        finally:
            await served["engine"].close()

    if flag:
        assert gateway.processor.chat_template == HERMES
        assert asyncio.run(ask()).body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    else:
        with pytest.raises(ValueError, match="--chat-template chatml-hermes"):
            asyncio.run(ask())
