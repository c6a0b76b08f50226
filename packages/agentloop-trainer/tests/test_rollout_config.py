"""The trainer -> core boundary: the trainer builds one frozen, typed ``RolloutConfig`` from the
training config, no dict, list or OmegaConf node anywhere in it, it survives pickling (Ray sends
it to the workers), and the manager of a real run receives exactly that record."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from agentloop_core.settings import RolloutConfig
from agentloop_trainer.config import load_config
from agentloop_trainer.stages.rollout_setup import rollout_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "trainer"
TRAIN_CONFIGS = sorted(p for p in EXAMPLES.glob("*.yaml") if "\ntools:" not in "\n" + p.read_text())
"""The example training configs (not the tool YAMLs they point at)."""

OPAQUE = {"reward_fn"}
"""Fields holding a user's object the record does not look inside: the reward hook is a callable
(the trainer's ``RewardScorer``, whose ``reward_kwargs`` are the user's keyword arguments)."""


def untyped_values(value: object, where: str) -> list[str]:
    """Where a dict, list, set or OmegaConf node sits in ``value``, walking dataclass fields and
    tuples; frozen dataclasses, tuples and scalars are what a record may hold."""
    if hasattr(value, "_metadata") and hasattr(value, "_get_node"):
        return [f"{where}: an OmegaConf {type(value).__name__}"]
    if isinstance(value, (dict, list, set)):
        return [f"{where}: a {type(value).__name__}"]
    if isinstance(value, tuple):
        return [bad for i, item in enumerate(value) for bad in untyped_values(item, f"{where}[{i}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        found = [] if type(value).__dataclass_params__.frozen else [f"{where}: a mutable {type(value).__name__}"]
        for f in dataclasses.fields(value):
            if f.name not in OPAQUE:
                found += untyped_values(getattr(value, f.name), f"{where}.{f.name}")
        return found
    if value is None or isinstance(value, (bool, int, float, str)):
        return []
    return [f"{where}: a {type(value).__name__}"]


def test_the_walker_finds_what_it_must_reject():
    record = RolloutConfig.from_mapping({"agent_loop_configs": {"single_turn_agent": {"x": [1]}}, "y": {"a": 1}})
    found = untyped_values(record, "record")
    assert found == ["record.agent_loop_configs[0][1][0][1]: a list", "record.loop_options[0][1]: a dict"]


def test_the_example_configs_are_found():
    assert {p.name for p in TRAIN_CONFIGS} == {"calculator_grpo.yaml", "gemma3_calculator.yaml", "gsm8k_tool_agent.yaml",
                                               "smollm2_calculator.yaml", "tiny_vlm_cards.yaml", "verl_gsm8k_multiturn.yaml"}


@pytest.mark.parametrize("config_file", [None, *TRAIN_CONFIGS], ids=lambda p: "defaults" if p is None else p.name)
def test_the_record_is_typed_all_the_way_down_and_pickles(config_file, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parents[1])  # the examples name their tool YAMLs from the repo root
    cfg = load_config(config_file=config_file, notice=lambda line: None)
    record = rollout_config(cfg, seed=7)
    assert isinstance(record, RolloutConfig)
    assert untyped_values(record, "record") == []
    # The default loop's typed config is built here, at start-up, under the loops' own names.
    loop = dict(record.agent_loop_configs)[record.default_agent_loop]
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (loop.tool_parser, loop.max_assistant_turns, loop.response_length) == (
        mt.tool_parser, mt.max_assistant_turns, cfg.data.max_response_length)
    assert record.sampling_params.max_tokens == mt.max_tokens_per_turn
    assert record.sampling_seed == 7
    again = pickle.loads(pickle.dumps(record))
    assert again == record
    assert again is not record


def test_the_verl_spelling_of_the_tool_parser_reads_as_the_new_key():
    lines: list[str] = []
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.format=llama3_json"], notice=lines.append)
    assert cfg.actor_rollout_ref.rollout.multi_turn.tool_parser == "llama3_json"
    assert lines == ["verl key actor_rollout_ref.rollout.multi_turn.format read as "
                     "actor_rollout_ref.rollout.multi_turn.tool_parser"]


def test_a_one_step_run_hands_the_manager_exactly_that_record(random_model_path, tmp_path, monkeypatch):
    from agentloop_core.runtime import AgentLoopManager, AgentLoopWorker
    from agentloop_trainer.cli import main

    received: list[object] = []
    built: list[RolloutConfig] = []
    init = AgentLoopManager.__init__
    worker_init = AgentLoopWorker.__init__

    def spy(self, server, tokenizer, config=None, **kwargs):
        received.append(config)
        init(self, server, tokenizer, config, **kwargs)

    def worker_spy(self, server, tokenizer, config=None, **kwargs):
        built.append(config)
        worker_init(self, server, tokenizer, config, **kwargs)

    monkeypatch.setattr(AgentLoopManager, "__init__", spy)
    monkeypatch.setattr(AgentLoopWorker, "__init__", worker_spy)
    assert main(["train", f"model.path={random_model_path}", "data.train_batch_size=1", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
                 "data.val_size=2", "trainer.total_steps=1", "trainer.test_freq=0", "trainer.save_freq=0",
                 "trainer.val_before_train=false", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}",
                 "trainer.experiment_name=boundary"]) == 0
    assert received
    assert all(isinstance(c, RolloutConfig) for c in received)
    assert untyped_values(received[0], "record") == []
    # The workers get the same object: nothing in between rebuilt it from a dict.
    assert built
    assert all(c is received[0] for c in built)
