"""Fixtures of the real-checkpoint suite: the converted SmolLM2-135M-Instruct folder and a
tool-aware copy of its tokenizer.

Every test here is marked ``real_model`` (see ``pytest_collection_modifyitems``). Without
``AGENTLOOP_REAL_MODEL_DIR`` or ``AGENTLOOP_REAL_MODEL=1`` each test skips, naming
``nox -s real_model``, which fetches the model once into the agentloop cache and sets them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from real_model_helpers import real_model_dir, save_tokenizer, tool_aware_tokenizer

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted checkpoint folder (config, float32 safetensors, tokenizer)."""
    return real_model_dir()


@pytest.fixture(scope="session")
def tool_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer with a ChatML + hermes tool-call template."""
    return tool_aware_tokenizer(model_dir)


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
