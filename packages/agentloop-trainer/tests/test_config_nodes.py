"""The typed meeting points of the loaded config and OmegaConf (agentloop_trainer.config.nodes)."""

import pytest
from omegaconf import DictConfig, OmegaConf

from agentloop_trainer.config import (
    ConfigError,
    TrainConfig,
    config_from_yaml,
    config_node,
    load_config,
    merged_config,
    plain_dict,
    to_yaml,
)


def test_plain_dict_is_a_resolved_str_keyed_dict_and_names_the_key_of_a_non_mapping():
    node = OmegaConf.create({"a": 1, "b": "${a}", "inner": {"c": [1, 2]}})
    out = plain_dict(node, "x")
    assert type(out) is dict
    assert out == {"a": 1, "b": 1, "inner": {"c": [1, 2]}}
    assert plain_dict(node, "x", resolve=False)["b"] == "${a}"
    with pytest.raises(ConfigError, match=r"config some\.key must be a mapping"):
        plain_dict(OmegaConf.create([1, 2]), "some.key")


def test_merged_config_leaves_the_loaded_config_as_it_was():
    cfg = load_config(["trainer.total_steps=3"])
    merged = merged_config(cfg, {"sft": {"resume": "auto"}})
    assert merged.sft.resume == "auto"
    assert merged.trainer.total_steps == 3
    assert cfg.sft.resume == "never"


def test_config_node_refuses_a_bare_dataclass_and_yaml_round_trips():
    cfg = load_config(["data.train_batch_size=4"])
    assert isinstance(config_node(cfg), DictConfig)
    with pytest.raises(TypeError, match="load_config"):
        config_node(TrainConfig())
    again = config_from_yaml(to_yaml(cfg))
    assert again.data.train_batch_size == 4
    assert to_yaml(again) == to_yaml(cfg)
