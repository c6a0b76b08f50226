"""Checks of bench_prefix_reuse's bookkeeping (not of timings): the prefill it reports must be
the tokens the engine computed for the workload, warm-up excluded, and its helpers must say
when they cannot tell."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_prefix_reuse import (  # noqa: E402
    TURNS,
    computed_prefill,
    cpu_bind,
    equal_fraction,
    prompts,
    run_hf,
    table_row,
    tool_result,
)


def test_cpu_bind_lists_the_first_allowed_cpus():
    assert cpu_bind(2, {5, 3, 9}) == "3,5"
    assert cpu_bind(1, {4}) == "4"


@pytest.mark.parametrize("threads", [0, 3])
def test_cpu_bind_refuses_more_threads_than_cpus(threads):
    with pytest.raises(ValueError, match="pass --threads between 1 and 2"):
        cpu_bind(threads, {0, 1})


def test_computed_prefill_subtracts_cached_tokens_and_says_when_unknown():
    assert computed_prefill([200, 264, 328], [0, 128, 256]) == 200 + 136 + 72
    assert computed_prefill([200, 264], [0, None]) is None


def test_equal_fraction_counts_whole_trajectories():
    ours = [[[1, 2], [3]], [[4], [5]]]
    assert equal_fraction(ours, [[[1, 2], [3]], [[4], [6]]]) == 0.5
    with pytest.raises(ValueError, match="numbers of trajectories"):
        equal_fraction(ours, ours[:1])


def test_workload_ids_stay_clear_of_special_tokens():
    ids = [i for p in prompts(8, 1000, 160, 40) for i in p] + tool_result(7, 3, 40, 1000)
    assert min(ids) >= 50
    assert max(ids) < 950


def test_hf_prefill_is_the_workloads_own_tokens():
    """Without a shared prefix and with the cache off, HFServer computes every prompt token of
    every turn, and the warm-up request is not counted; with the cache on it computes fewer,
    with the same greedy tokens."""
    from agentloop_engines.testing.tiny_model import build_tiny_model

    args = argparse.Namespace(trajectories=3, shared=0, own=12, gen=4, tool=5, threads=1, cache_tokens=4096)
    model = str(build_tiny_model())
    off = asyncio.run(run_hf(model, False, args))
    on = asyncio.run(run_hf(model, True, args))
    assert off["prefill_tokens_per_trajectory"] == off["prompt_tokens_per_trajectory"]
    assert len(off["prompt_tokens"]) == 3 * TURNS
    assert on["prefill_tokens_per_trajectory"] < off["prefill_tokens_per_trajectory"]
    assert on["prefix_cache_hits"] == 3 * (TURNS - 1)
    assert on["tokens"] == off["tokens"]


def test_table_row_shows_what_the_engine_did_not_report():
    run = {"engine": "VLLMServer", "enable_prefix_caching": True, "block_size": 32, "vocab_size": 100,
           "tokens": [[[1]], [[2]]], "prompt_tokens": [3, 3], "prefill_tokens_per_trajectory": None,
           "prefill_over_distinct": None, "prefix_cache_hits": None, "distinct_tokens_per_trajectory": 4.0,
           "rollout_tokens_per_s": 10.0, "load_average_after": [1.5, 1.0, 0.5]}
    row = table_row("vllm_on", run, [[[1]], [[3]]], 100)
    assert row[0] == "VLLMServer (on, block 32)"
    assert row[1] == row[3] == row[5] == "n/a (no num_cached_tokens)"
    assert row[6] == run["greedy_equal_to_hf_off"] == 0.5
    assert table_row("vllm_off", {"error": "boom\nRuntimeError: no CPU"}, [], 100)[-1] == "RuntimeError: no CPU"
    with pytest.raises(SystemExit, match="vocab size 100 differs"):
        table_row("x", run | {"tokens": []}, [], 7)
