"""Fixtures of the real-checkpoint suite: a converted checkpoint's folder and a tool-aware copy
of its tokenizer, for each of :data:`real_model_helpers.MODELS` (SmolLM2-135M-Instruct and
gemma-3-270m; test ids ``[smollm2]``, ``[gemma3]``).

Every fixture below follows ``real_model``, which ``pytest_generate_tests`` parametrizes over
both models; a module that runs one model only says so with ``REAL_MODELS = ["smollm2"]`` (the
vLLM and gateway tests). Tests that use none of these fixtures are not parametrized.

Every test here is marked ``real_model`` (see ``pytest_collection_modifyitems``). Without a
model's folder variable (``AGENTLOOP_REAL_MODEL_DIR``, ``AGENTLOOP_REAL_GEMMA_DIR``) or
``AGENTLOOP_REAL_MODEL=1`` its tests skip, naming ``nox -s real_model``, which fetches the
models once into the agentloop cache and sets them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from real_model_helpers import MODELS, RealModel, real_model_dir, save_tokenizer, tool_aware_tokenizer

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_model)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "real_model" in metafunc.fixturenames:
        # Session scope: pytest runs every test of one model before loading the other.
        ids = getattr(metafunc.module, "REAL_MODELS", list(MODELS))
        metafunc.parametrize("real_model", ids, indirect=True, scope="session")


@pytest.fixture(scope="session")
def real_model(request: pytest.FixtureRequest) -> RealModel:
    """The checkpoint a test runs (a :data:`real_model_helpers.MODELS` key as the param)."""
    return MODELS[request.param]


@pytest.fixture(scope="session")
def model_dir(real_model: RealModel) -> Path:
    """The converted checkpoint folder (config, float32 safetensors, tokenizer)."""
    return real_model_dir(real_model)


@pytest.fixture(scope="session")
def tool_tokenizer(model_dir: Path, real_model: RealModel) -> Any:
    """The checkpoint's tokenizer with its tool-aware template (hermes tool calls)."""
    return tool_aware_tokenizer(model_dir, real_model.tool_template)


@pytest.fixture(scope="session")
def tool_tokenizer_dir(tool_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`tool_tokenizer` saved as a folder, for ``model.tokenizer_path`` and the loop
    workers (which load tokenizers by path)."""
    return save_tokenizer(tool_tokenizer, tmp_path_factory.mktemp("tool-tokenizer"))


@pytest.fixture(scope="session")
def tool_fitted_model(model_dir: Path, tool_tokenizer: Any) -> Any:
    """The checkpoint after a few SFT steps on the calculator demonstrations
    (:func:`real_model_helpers.fit_tool_calls`): it then writes hermes tool calls, which the raw
    checkpoint does not. Shared; tests that change weights take a copy."""
    import torch
    from real_model_helpers import fit_tool_calls, report
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    losses = fit_tool_calls(model, tool_tokenizer)
    report(f"tool-call fit losses: {[round(x, 3) for x in losses]}")
    return model
