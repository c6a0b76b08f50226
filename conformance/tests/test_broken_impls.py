"""The suite can fail: each deliberately broken implementation (tests/broken_impls.py) is run
through the no-code mode in-process, and must be caught by the right check and only by the
checks its bug explains."""

from __future__ import annotations

import pytest


def failed_checks(tmp_path, *options: str) -> tuple[set[str], set[str]]:
    """Run the packaged suite in-process with ``options``, as a third party would (empty ini,
    strict asyncio mode); return (failed, passed) test names with their parameters."""
    from agentloop_conformance.cli import ReportCollector

    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    collector = ReportCollector()
    pytest.main(["--pyargs", "agentloop_conformance", "-q", "-p", "no:cacheprovider", "-c", str(ini),
                 "--rootdir", str(tmp_path), *options], plugins=[collector])
    failed = {r.nodeid.split("::", 1)[-1] for r in collector.results.values() if r.outcome in ("FAIL", "ERROR")}
    passed = {r.nodeid.split("::", 1)[-1] for r in collector.results.values() if r.outcome == "PASS"}
    return failed, passed


def names(checks: set[str]) -> set[str]:
    return {c.split("::")[-1].split("[")[0] for c in checks}


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))


def test_wrong_log_probs_are_caught_by_the_reference_check(tmp_path):
    pytest.importorskip("torch", reason='needs pip install "agentloop-engines[hf]"')
    failed, passed = failed_checks(tmp_path, "--agentloop-engine=broken_impls:wrong_logprobs_engine", "-k",
                                   "TestEngine and (log_probs or greedy or max_tokens or stop)")
    assert names(failed) == {"test_log_probs_match_reference"}, failed
    assert "TestEngine::test_log_probs_present_and_valid[1.0]" in passed


def test_ignored_stop_tokens_are_caught_by_the_stop_check(tmp_path):
    pytest.importorskip("torch", reason='needs pip install "agentloop-engines[hf]"')
    failed, passed = failed_checks(tmp_path, "--agentloop-engine=broken_impls:ignores_stop_engine", "-k",
                                   "TestEngine and not abort and not weights and not concurrent")
    assert failed == {"TestEngine::test_stop_token_ids_honoured"}, failed
    assert "TestEngine::test_max_tokens_respected[7]" in passed


def test_an_async_forget_session_is_caught_by_the_forget_check(tmp_path):
    pytest.importorskip("torch", reason='needs pip install "agentloop-engines[hf]"')
    failed, passed = failed_checks(tmp_path, "--agentloop-engine=broken_impls:async_forget_engine", "-k",
                                   "TestEngine and (forget or greedy or sleep)", "-W",
                                   "ignore::RuntimeWarning")
    assert names(failed) == {"test_forget_session_between_turns_keeps_outputs"}, failed
    assert "test_greedy_is_deterministic" in names(passed)


def test_an_engine_that_ignores_images_is_caught_by_the_vision_checks(tmp_path):
    """The image-blind engine (its default vision prompts built from the checkpoint folder, as
    for any engine in no-code mode) fails the check that images change the output; the only
    other check it may fail is the mismatch refusal (it never looks at the images)."""
    pytest.importorskip("torch", reason='needs pip install "agentloop-engines[hf]"')
    failed, passed = failed_checks(tmp_path, "--agentloop-engine=broken_impls:ignores_images_engine", "-k",
                                   "TestEngine and vision")
    assert "TestEngine::test_vision_images_change_the_output" in failed, (failed, passed)
    assert names(failed) <= {"test_vision_images_change_the_output",
                             "test_vision_images_not_matching_the_prompt_are_a_value_error"}, failed
    assert {"TestEngine::test_vision_video_is_a_value_error",
            "TestEngine::test_vision_prompt_with_images_gives_valid_output"} <= passed, passed


def test_an_engine_that_samples_placeholders_is_caught_by_the_placeholder_check(tmp_path):
    """An engine that does not ban the image/video placeholder ids fails only the check that
    none is generated (on the placeholder-preferring copy); its other vision checks pass."""
    pytest.importorskip("torch", reason='needs pip install "agentloop-engines[hf]"')
    failed, passed = failed_checks(tmp_path, "--agentloop-engine=broken_impls:samples_placeholders_engine", "-k",
                                   "TestEngine and vision")
    assert failed == {"TestEngine::test_vision_never_generates_placeholder_tokens"}, failed
    assert "TestEngine::test_vision_prompt_with_images_gives_valid_output" in passed, passed


def test_a_loop_that_reencodes_text_is_caught_by_the_mask_check(tmp_path):
    failed, passed = failed_checks(tmp_path, "--agentloop-loop=broken_impls:reencoding_loop", "-k", "TestAgentLoop")
    assert "TestAgentLoop::test_mask_one_tokens_are_the_engine_output[scripted]" in failed
    # Its consequences may fail too; nothing unrelated may.
    assert names(failed) <= {"test_mask_one_tokens_are_the_engine_output", "test_log_probs_aligned_with_mask",
                             "test_no_tool_or_user_token_has_mask_one"}, failed
    assert "TestAgentLoop::test_response_length_within_budget[scripted]" in passed


MASK_CHECKS = {"test_mask_one_tokens_are_the_engine_output", "test_log_probs_aligned_with_mask",
               "test_no_tool_or_user_token_has_mask_one"}
BROKEN_LOOPS = {
    # defect: (the check that names it, the checks its consequences may also fail)
    "mask_one_on_tool_tokens": ("test_no_tool_or_user_token_has_mask_one", MASK_CHECKS),
    "mask_zero_on_a_generated_token": ("test_mask_one_tokens_are_the_engine_output", MASK_CHECKS),
    "log_probs_off_by_one": ("test_log_probs_aligned_with_mask", set()),
    "reencoded_responses": ("test_mask_one_tokens_are_the_engine_output", MASK_CHECKS),
    "budget_overflow": ("test_response_length_within_budget", set()),
    "dropped_tool_result": ("test_tool_results_reach_the_model", set()),
}


@pytest.mark.parametrize("loop", ["tool_agent", "react_agent"])
@pytest.mark.parametrize("defect", sorted(BROKEN_LOOPS))
def test_a_broken_tool_loop_is_caught_in_no_code_mode(tmp_path, loop, defect):
    """Broken copies of tool_agent and react_agent, run with the suite's own tool scenarios
    (no replies given): each fails the check naming its defect, and nothing unrelated."""
    pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    if loop == "react_agent":
        pytest.importorskip("agentloop_langgraph", reason="needs pip install agentloop-langgraph")
    check, consequences = BROKEN_LOOPS[defect]
    failed, passed = failed_checks(tmp_path, f"--agentloop-loop=broken_impls:{loop}__{defect}", "-k",
                                   "TestAgentLoop and not real")
    assert f"TestAgentLoop::{check}[scripted]" in failed, failed
    assert names(failed) <= {check, *consequences}, failed
    assert "TestAgentLoop::test_turn_kinds_exercised" in passed


@pytest.mark.parametrize("defect", ["mask_one_on_tool_tokens", "dropped_tool_result", "reencoded_responses"])
def test_a_broken_env_loop_is_caught_in_no_code_mode(tmp_path, defect):
    """Broken copies of env_agent (its environment answering calculator calls): each fails the
    check naming its defect, and nothing unrelated."""
    pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    check, consequences = BROKEN_LOOPS[defect]
    failed, passed = failed_checks(tmp_path, f"--agentloop-loop=broken_impls:env_agent__{defect}", "-k",
                                   "TestAgentLoop and not real")
    assert f"TestAgentLoop::{check}[scripted]" in failed, failed
    assert names(failed) <= {check, *consequences}, failed
    assert "TestAgentLoop::test_turn_kinds_exercised" in passed


@pytest.mark.parametrize("loop", ["tool_agent", "react_agent", "tool_agent_with_user", "env_agent"])
def test_the_unbroken_tool_loops_pass_in_no_code_mode(tmp_path, loop):
    pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    if loop == "react_agent":
        pytest.importorskip("agentloop_langgraph", reason="needs pip install agentloop-langgraph")
    failed, passed = failed_checks(tmp_path, f"--agentloop-loop=loop_factories:{loop}", "-k", "TestAgentLoop")
    assert not failed, failed
    assert {"TestAgentLoop::test_tool_results_reach_the_model[scripted]",
            "TestAgentLoop::test_turn_kinds_exercised"} <= passed


def test_a_tool_loop_whose_replies_call_no_tool_fails_the_turn_kinds_check(tmp_path):
    pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    replies = tmp_path / "replies.json"
    replies.write_text('["The answer is 5.\\n#### 5"]')
    failed, _ = failed_checks(tmp_path, "--agentloop-loop=loop_factories:tool_agent",
                              f"--agentloop-replies={replies}", "-k", "TestAgentLoop and not real")
    assert failed == {"TestAgentLoop::test_turn_kinds_exercised"}, failed


@pytest.mark.parametrize(("loop", "expected"), [
    ("tool_agent", "tools calculator (hermes); exercised: tool_call, parallel_calls, malformed_call, unknown_tool, "
                   "tool_error, truncated, final_answer; not exercised: user_turn"),
    ("tool_agent_with_user", "exercised: tool_call, parallel_calls, malformed_call, unknown_tool, tool_error, "
                             "truncated, user_turn, final_answer; not exercised: none"),
])
def test_the_command_prints_the_turn_kinds_it_exercised(capsys, tmp_path, monkeypatch, loop, expected):
    pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    from agentloop_conformance.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["--loop", f"loop_factories:{loop}", "-k", "turn_kinds"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("turn kinds (TestAgentLoop): "))
    assert expected in line, line


def test_the_loop_suite_takes_the_tokenizer_option(tmp_path):
    """--agentloop-tokenizer reaches a (server, tokenizer) loop factory."""
    pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    failed, passed = failed_checks(tmp_path, "--agentloop-loop=loop_factories:tool_agent",
                                   "--agentloop-tokenizer=loop_factories:tiny_tokenizer", "-k",
                                   "TestAgentLoop and turn_kinds")
    import loop_factories

    assert not failed, (failed, passed)
    assert passed == {"TestAgentLoop::test_turn_kinds_exercised"}, (failed, passed)
    assert loop_factories.GIVEN_TOKENIZERS, "the factory was not given the tokenizer"


def test_segments_scored_one_by_one_are_caught_by_the_segment_check(tmp_path):
    failed, passed = failed_checks(tmp_path, "--agentloop-loop=broken_impls:unshared_reward_loop", "-k",
                                   "TestAgentLoop")
    assert failed == {"TestAgentLoop::test_segments_are_numbered_and_share_one_reward[scripted]"}, failed
    # Its tokens are right, segment by segment.
    assert {"TestAgentLoop::test_mask_one_tokens_are_the_engine_output[scripted]",
            "TestAgentLoop::test_no_tool_or_user_token_has_mask_one[scripted]"} <= passed


def test_a_tokenizer_dropping_the_newline_after_end_of_turn_is_caught(tmp_path):
    failed, passed = failed_checks(tmp_path, "--agentloop-tokenizer=broken_impls:newline_dropping_tokenizer",
                                   "-k", "TestTokenizer")
    assert "TestTokenizer::test_text_round_trip_is_lossless[single_turn]" in failed
    assert "TestTokenizer::test_delta_equals_full_tokenization[tool_calls_several_rounds]" in failed
    assert names(failed) == {"test_text_round_trip_is_lossless", "test_delta_equals_full_tokenization",
                             "test_decoded_ids_render_the_template_text"}, failed
    assert {n for n in passed if "kept_verbatim" in n or "masks_align" in n}, "unrelated checks should pass"


def test_guard_catches_a_removed_or_silently_overridden_check(pytester):
    # The inner run does not see the repo's pytest settings; these are the ones the suite needs.
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_guarded="""
        import pytest
        from agentloop_conformance import EngineConformanceTests

        class TestRemoved(EngineConformanceTests):
            test_stop_token_ids_honoured = None

        class TestOverridden(EngineConformanceTests):
            async def test_greedy_is_deterministic(self, engine):
                pass

        class TestXfailed(EngineConformanceTests):
            @pytest.mark.xfail(reason="our sampler is not batch-invariant")
            async def test_greedy_is_deterministic(self, engine):
                assert False
    """)
    reprec = pytester.inline_run("-p", "no:cacheprovider", "-k", "overridden")
    outcome = {r.nodeid.split("::")[1]: r.outcome for r in reprec.getreports("pytest_runtest_logreport")
               if r.when == "call"}
    assert outcome == {"TestRemoved": "failed", "TestOverridden": "failed", "TestXfailed": "passed"}, outcome
