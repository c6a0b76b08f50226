"""The tiny Qwen2 checkpoint: a real HF folder with the tiny tokenizer, built once."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason='the tiny model needs pip install "agentloop-engines[hf]"')
transformers = pytest.importorskip("transformers", reason='needs pip install "agentloop-engines[hf]"')

from agentloop_core.testing import load_tiny_tokenizer  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_loads_with_auto_classes(built):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(built))
    tok = transformers.AutoTokenizer.from_pretrained(str(built))
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 2, 4, 2)
    assert (cfg.intermediate_size, cfg.max_position_embeddings) == (512, 2048)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_tokenizer_ids_survive_the_copy(built):
    text = 'Ann has 12 apples.<tool_call>\n{"name": "calculator"}\n</tool_call><|im_end|>'
    reference = load_tiny_tokenizer()
    tok = transformers.AutoTokenizer.from_pretrained(str(built))
    assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    assert tok.chat_template == reference.chat_template


def test_same_seed_same_weights_and_cached(built, tmp_path):
    import torch

    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(built, seed=3) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp, "a complete build must be reused"
    again = build_tiny_model(tmp_path / "again", seed=3)
    other = build_tiny_model(tmp_path / "other", seed=4)
    load = transformers.AutoModelForCausalLM.from_pretrained
    a, b, c = (load(str(p)).model.embed_tokens.weight for p in (built, again, other))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert json.loads((built / "agentloop_tiny_model.json").read_text())["seed"] == 3


def test_default_location_depends_on_the_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path))
    default = build_tiny_model(num_layers=1)
    assert default.parent == tmp_path
    assert default.name.startswith("tiny-qwen2-v1-")
    assert transformers.AutoConfig.from_pretrained(str(default)).num_hidden_layers == 1


@pytest.mark.parametrize(("kwargs", "match"), [({"num_heads": 3}, "must divide hidden_size"),
                                               ({"num_kv_heads": 3}, "must divide num_heads")])
def test_bad_shapes_are_rejected(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path / "x", **kwargs)
