"""What FSDP2 shards layer by layer: a text model's decoder layers, and a vision-language
model's decoder layers and vision blocks, where they sit deeper than ``model.layers``."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from agentloop_engines.adapters.hf.vision import load_model
from agentloop_engines.testing.tiny_model import build_tiny_model
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm
from agentloop_trainer.update.fsdp import shard_policy


@pytest.fixture
def one_rank():
    """A gloo group of one process: enough for ``fully_shard`` to wrap a module."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _units(model) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


@pytest.mark.parametrize(("family", "language", "vision"), [
    ("qwen2_vl", "model.language_model.layers", "model.visual.blocks"),
    ("idefics3", "model.text_model.layers", "model.vision_model.encoder.layers"),
])
def test_a_vision_language_model_is_sharded_layer_by_layer(one_rank, family, language, vision):
    model = shard_policy(load_model(str(build_tiny_vlm(family=family)), torch.float32))
    units = _units(model)
    assert units[0] == ""  # the root
    layers = len(model.get_decoder().layers)
    assert [u for u in units if u.startswith(f"{language}.")] == [f"{language}.{i}" for i in range(layers)]
    assert any(u.startswith(f"{vision}.") for u in units), units


def test_a_text_model_keeps_its_decoder_layers_as_the_units(one_rank):
    model = shard_policy(load_model(str(build_tiny_model()), torch.float32))
    assert _units(model) == ["", *(f"model.layers.{i}" for i in range(len(model.model.layers)))]
