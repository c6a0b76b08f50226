"""``model.dtype=auto``: bfloat16 mixed precision only where the device computes bfloat16 natively,
float32 elsewhere (on a CPU without AVX512_BF16 or AMX autocast is many times slower than
float32), resolved once when the config is loaded; an explicit bfloat16 on such a CPU is kept
with a notice naming the fix; and no shipped recipe hard-codes bfloat16."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from test_rollout_config import TRAIN_CONFIGS

from agentloop_trainer.config import ConfigError, load_config, to_yaml
from agentloop_trainer.policy import precision
from agentloop_trainer.policy.precision import cpu_has_native_bf16, resolve_dtype


def _resolve(dtype: str, device: str, native: bool) -> tuple[str, list[str]]:
    lines: list[str] = []
    return resolve_dtype(dtype, device, lines.append, native=lambda _device: native), lines


def test_auto_is_bfloat16_only_where_it_is_native_and_says_what_it_chose_otherwise():
    assert _resolve("auto", "cpu", True) == ("bfloat16", [])
    assert _resolve("auto", "cuda", True) == ("bfloat16", [])
    dtype, lines = _resolve("auto", "cpu", False)
    assert dtype == "float32"
    assert len(lines) == 1
    assert "model.dtype=auto: float32 on cpu" in lines[0]


def test_an_explicit_bfloat16_on_a_cpu_without_it_is_kept_with_a_notice_naming_the_fix():
    dtype, lines = _resolve("bfloat16", "cpu", False)
    assert dtype == "bfloat16", "the user's choice of numerics is kept"
    assert len(lines) == 1
    assert "slower than float32" in lines[0]
    assert "model.dtype=auto or float32" in lines[0]
    assert _resolve("bfloat16", "cpu", True) == ("bfloat16", [])
    assert _resolve("float32", "cpu", False) == ("float32", [])
    assert _resolve("float32", "cuda", True) == ("float32", [])


def test_auto_loads_resolved_for_this_machine_and_the_run_records_the_concrete_dtype():
    lines: list[str] = []
    cfg = load_config(["model.dtype=auto"], notice=lines.append)
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert cfg.model.dtype == expected
    assert f"dtype: {expected}" in to_yaml(cfg)
    assert any("model.dtype=auto" in line for line in lines) == (expected == "float32")
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(["model.dtype=float16"])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").exists(),
                    reason="the CPU's flags are read from /proc/cpuinfo on x86 Linux")
def test_the_probe_agrees_with_the_cpus_own_flags():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.mark.parametrize("recipe", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_no_shipped_recipe_asks_a_cpu_without_bfloat16_for_it(recipe, monkeypatch):
    """A recipe that says bfloat16 for its speed on one CPU is ~30x slower on the next; the
    shipped ones say auto (or float32)."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    lines: list[str] = []
    cfg = load_config([], recipe, notice=lines.append)
    assert [line for line in lines if "model.dtype=bfloat16 on a CPU" in line] == []
    assert cfg.model.dtype == "float32"


def test_a_cuda_device_this_process_cannot_see_is_taken_to_compute_bfloat16(monkeypatch):
    """A Ray driver without a GPU resolves for its ranks' GPUs (every one since Ampere has it)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.bf16_is_native("cuda")
    assert precision.bf16_is_native("cuda:1")
    assert resolve_dtype("auto", "cuda", lambda line: None) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert not precision.bf16_is_native("cuda"), "an emulated bfloat16 (before Ampere) is not native"
