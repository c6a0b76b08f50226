"""The generated config reference names every key of the config with its default."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "docs"))

import config_reference  # noqa: E402


def _leaf_defaults() -> dict[str, object]:
    """Every leaf key of the defaults, as `agentloop train --show-config` has them (OmegaConf)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    from agentloop_trainer.config import FREE_FORM, TrainConfig

    out: dict[str, object] = {}

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not (path + ".").startswith(FREE_FORM):
                walk(child, path + ".")
            else:
                out[path] = OmegaConf.to_container(child) if isinstance(child, (DictConfig, ListConfig)) else node[key]
    walk(OmegaConf.structured(TrainConfig), "")
    return out


def test_every_key_appears_with_its_default() -> None:
    page = config_reference.render()
    keys = _leaf_defaults()
    assert len(keys) > 100, f"only {len(keys)} keys: the walk over the config is broken"
    missing = [k for k, v in keys.items()
               if f"- **`{k}`** = `{config_reference.format_default(v)}`" not in page]
    assert not missing, f"keys missing from the reference (or with another default): {missing}"


def test_verl_spellings_are_listed() -> None:
    page = config_reference.render()
    assert "- **`trainer.total_steps`** = `20` (verl: `trainer.total_training_steps`)" in page
    assert "(verl: `actor_rollout_ref.actor.clip_ratio`)" in page
    assert "`algorithm.use_kl_in_reward` = `false`" in page


def test_a_key_added_to_a_section_appears(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys come from the dataclasses, not a list: a new field shows up with its doc and default."""
    import dataclasses

    import agentloop_trainer.config as config

    @dataclasses.dataclass
    class Extended(config.DataSection):
        brand_new_key: int = 7
        """A key nobody documented by hand."""

    @dataclasses.dataclass
    class Root(config.TrainConfig):
        data: Extended = dataclasses.field(default_factory=Extended)

    monkeypatch.setattr(config, "TrainConfig", Root)
    page = config_reference.render()
    assert "- **`data.brand_new_key`** = `7`\n    A key nobody documented by hand." in page
    assert "- **`data.train_batch_size`** = `16`\n    Prompts per GRPO step." in page
