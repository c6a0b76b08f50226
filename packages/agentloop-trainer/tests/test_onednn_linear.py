"""model.cpu_matmul=onednn: the policy's linear layers multiply on oneDNN, forward and backward,
with torch's results (to float32 rounding), also under LoRA, and keep everything else a linear
layer is (state dict, copies, other dtypes)."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")

from agentloop_trainer.policy.onednn_linear import OneDNNLinear, onednn_works, use_onednn_linears  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn_works(), reason="this torch has no working oneDNN linear")


def _pair(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    ours = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 16, bias=False))
    theirs = copy.deepcopy(ours)
    assert use_onednn_linears(ours) == 2
    return ours, theirs


def test_forward_and_gradients_are_torchs():
    ours, theirs = _pair()
    x = torch.randn(3, 7, 24)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    weights = torch.randn(ya.shape)
    (ya * weights).sum().backward()
    (yb * weights).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_a_frozen_base_under_lora_trains_only_the_adapters():
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    base = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False)
    theirs = peft.get_peft_model(copy.deepcopy(base), config)
    ours = peft.get_peft_model(base, config)
    ours.load_state_dict(theirs.state_dict())
    assert use_onednn_linears(ours) > 2  # the two base layers and their adapters
    x = torch.randn(5, 16)
    ours(x).pow(2).sum().backward()
    theirs(x).pow(2).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_state_dict_copies_and_other_dtypes_are_a_linear_layers():
    ours, theirs = _pair()
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert isinstance(ours[0], torch.nn.Linear)
    assert type(ours[0]) is OneDNNLinear
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    clone = copy.deepcopy(ours)
    x = torch.randn(4, 24)
    for other in (loaded, clone):
        torch.testing.assert_close(other(x), theirs(x), atol=1e-5, rtol=1e-5)
    half = copy.deepcopy(ours).to(torch.bfloat16)  # another dtype: nn.Linear's own forward
    assert half(x.bfloat16()).dtype == torch.bfloat16


def test_under_autocast_the_product_is_autocasts():
    """Mixed precision (model.dtype=bfloat16 on one process) computes under torch.autocast: the
    layer must give autocast's bfloat16 result, not a float32 product autocast never sees."""
    ours, theirs = _pair()
    x = torch.randn(3, 7, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = ours(x), theirs(x)
    assert ya.dtype == yb.dtype == torch.bfloat16
    assert torch.equal(ya, yb)


def test_the_config_key_is_checked():
    from agentloop_trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.cpu_matmul"):
        load_config(["model.cpu_matmul=mkl"])
