"""``weight_check``: a weight update is checked whole against what the model holds, and the
checkpoint reader gives vLLM and SGLang the names, shapes and dtype kinds to check against."""

from __future__ import annotations

import json

import pytest

from agentloop_engines.adapters.weight_check import (
    WeightSpec,
    WeightUpdateError,
    check_weight_update,
    checkpoint_weight_specs,
    dtype_kind,
)
from agentloop_engines.serving.control import check_control_key, is_chat_path

torch = pytest.importorskip("torch", reason='weight tests need torch: pip install "agentloop-engines[hf]"')

SPECS = {"a.weight": WeightSpec((2, 3), "float"), "step": WeightSpec((), "int"), "any": WeightSpec(None, None)}


@pytest.mark.parametrize(("dtype", "kind"), [
    (torch.float32, "float"), (torch.bfloat16, "float"), (torch.float8_e4m3fn, "float"), (torch.int64, "int"),
    (torch.uint8, "int"), (torch.bool, "bool"), (torch.complex64, "complex"), ("F32", "float"), ("BF16", "float"),
    ("F8_E4M3", "float"), ("I64", "int"), ("U8", "int"), ("BOOL", "bool"), (int, "int"), (float, "float"),
    (bool, "bool"), ("nonsense", None)])
def test_dtype_kinds(dtype, kind):
    assert dtype_kind(dtype) == kind


def test_a_good_update_passes_whole_and_in_order():
    pairs = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("step", 3), ("any", torch.zeros(7))]
    assert check_weight_update(iter(pairs), SPECS) == pairs


def test_every_bad_tensor_is_named_in_one_error():
    bad = [("a.weigth", torch.zeros(2, 3)), ("a.weight", torch.zeros(3, 2)), ("step", torch.tensor(1.5)),
           ("step", [1, 2])]
    with pytest.raises(WeightUpdateError) as info:
        check_weight_update(bad, SPECS, engine="the test model")
    message = str(info.value)
    assert "4 of 4 tensors do not fit the test model, so nothing was loaded" in message
    assert "no weight named 'a.weigth' (did you mean 'a.weight'?)" in message
    assert "'a.weight' has shape (3, 2), the model expects (2, 3)" in message
    assert "'step' has dtype float32 (float), the model holds a int tensor" in message
    assert "'step' is a list, not a tensor" in message
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KeyError)  # callers of the older per-tensor KeyError still catch it


def test_past_ten_problems_the_rest_are_counted():
    with pytest.raises(WeightUpdateError, match="and 5 more"):
        check_weight_update([(f"w{i}", torch.zeros(1)) for i in range(15)], SPECS)


def test_checkpoint_specs_from_safetensors_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
               "step": torch.tensor(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    specs = checkpoint_weight_specs(tmp_path)
    assert specs == {"model.embed_tokens.weight": WeightSpec((10, 4), "float"),
                     "model.norm.weight": WeightSpec((4,), "float"), "step": WeightSpec((), "int"),
                     "lm_head.weight": WeightSpec((10, 4), "float")}  # tied: the embedding's spec
    # An index whose shard cannot be read still names the weights.
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model.safetensors", "x.weight": "missing.safetensors"}}))
    specs = checkpoint_weight_specs(tmp_path)
    assert specs is not None
    assert specs["x.weight"] == WeightSpec(None, None)
    assert specs["model.norm.weight"] == WeightSpec((4,), "float")
    assert checkpoint_weight_specs(tmp_path / "nowhere") is None
    lfs = tmp_path / "lfs"
    lfs.mkdir()
    (lfs / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    assert checkpoint_weight_specs(lfs) is None


@pytest.mark.parametrize(("path", "chat"), [
    ("/generate", True), ("/forget_session", True), ("/v1/chat/completions", True), ("/v1/completions", True),
    ("/v1/models", True), ("/sessions/s1/k3y/v1/chat/completions", True), ("/sessions/s1/v1/models", True),
    ("/update_weights", False), ("/sleep", False), ("/wake_up", False), ("/abort", False), ("/sessions", False),
    ("/sessions/s1", False), ("/sessions/s1/k3y", False), ("/sessions/s1/k3y/v1", False), ("/v1/chat", False),
    ("/generate/", False), ("//generate", False), ("/v1/models/x", False), ("/anything", False),
    ("/forget_sessions", False), ("/forget_session/x", False), ("/forgetXsession", False)])
def test_every_path_off_the_chat_allow_list_is_control(path, chat):
    assert is_chat_path(path) is chat


def test_a_control_key_must_be_its_own():
    check_control_key(None, "k")
    check_control_key("c", "k")
    for bad in ("", " spaced ", "k"):
        with pytest.raises(ValueError, match="control_key"):
            check_control_key(bad, "k")
