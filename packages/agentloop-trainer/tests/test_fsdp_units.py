"""What FSDP2 shards layer by layer: a text model's decoder layers, and a vision-language
model's, which sit deeper than ``model.layers``; its vision tower stays in the root unit (ranks
without images never run it)."""

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


@pytest.mark.parametrize(("family", "language"), [
    ("qwen2_vl", "model.language_model.layers"), ("idefics3", "model.text_model.layers")])
def test_a_vision_language_model_is_sharded_layer_by_layer(one_rank, family, language):
    model = shard_policy(load_model(str(build_tiny_vlm(family=family)), torch.float32))
    layers = len(model.get_decoder().layers)
    assert layers >= 2
    assert _units(model) == ["", *(f"{language}.{i}" for i in range(layers))]


def test_a_text_model_keeps_its_decoder_layers_as_the_units(one_rank):
    model = shard_policy(load_model(str(build_tiny_model()), torch.float32))
    assert _units(model) == ["", *(f"model.layers.{i}" for i in range(len(model.model.layers)))]
