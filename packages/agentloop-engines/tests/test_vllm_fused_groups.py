"""VLLMServer refuses a weight push that brings part of a group vLLM fuses (q/k/v, gate/up):
vLLM's in-place reload would leave the missing parts uninitialised. No vLLM needed: the check
runs before anything reaches the engine."""

from __future__ import annotations

import asyncio

import pytest

from agentloop_engines.adapters.vllm.server import VLLMServer, incomplete_fused_groups

ATTN, MLP = "model.layers.3.self_attn.", "model.layers.3.mlp."
WHOLE_LAYER = [ATTN + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
    MLP + p + ".weight" for p in ("gate_proj", "up_proj", "down_proj")] + ["model.layers.3.input_layernorm.weight"]


def test_whole_layers_and_unfused_weights_pass():
    assert incomplete_fused_groups(WHOLE_LAYER + ["model.embed_tokens.weight", "lm_head.weight"]) == []
    assert incomplete_fused_groups([ATTN + "o_proj.weight", MLP + "down_proj.weight"]) == []


@pytest.mark.parametrize(("dropped", "reported"), [
    (ATTN + "k_proj.weight", ATTN + "q_proj.weight without " + ATTN + "k_proj.weight"),
    (ATTN + "q_proj.weight", ATTN + "k_proj.weight without " + ATTN + "q_proj.weight"),
    (MLP + "gate_proj.weight", MLP + "up_proj.weight without " + MLP + "gate_proj.weight"),
])
def test_a_missing_sibling_is_named_once(dropped, reported):
    assert incomplete_fused_groups([n for n in WHOLE_LAYER if n != dropped]) == [reported]


class _NoEngine:
    """Stands in for AsyncLLM: any call into it is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"the engine was reached ({name}) although the push was refused")


def test_update_weights_refuses_a_split_group_before_the_engine():
    torch = pytest.importorskip("torch", reason="the weights are torch tensors")
    server = object.__new__(VLLMServer)  # no AsyncLLM: the check must come first
    server.engine = _NoEngine()
    server.weight_specs = None  # no checkpoint headers: only the fused-group check is left to refuse
    weights = [(ATTN + "q_proj.weight", torch.zeros(2, 2)), (ATTN + "v_proj.weight", torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="k_proj.*Push each layer's q/k/v"):
        asyncio.run(server.update_weights(weights))
