"""A conversation the chat template refuses as written (``raise_exception``) skips with the
template's message; a crash (in the template or in the code under test) still fails, and a
template that refuses generated markup in assistant content never sees any. The suite runs in-process through the no-code mode, as a
third party would run it."""

from __future__ import annotations

import pathlib

import pytest

from agentloop_core.testing import chat_template

TINY = "--agentloop-tokenizer=agentloop_core.testing:load_tiny_tokenizer"
REFUSAL = "This model only supports single tool-calls at once!"  # Llama 3.1's words
# The tiny tokenizer's template, refusing an assistant turn with several tool calls.
REFUSES_PARALLEL_CALLS = (
    "{%- for m in messages %}{%- if m.tool_calls is defined and m.tool_calls and m.tool_calls | length > 1 %}"
    "{{- raise_exception('" + REFUSAL + "') }}{%- endif %}{%- endfor %}"
)
# The same check written as a template bug: adding a number to none raises TypeError in Jinja.
CRASHES_ON_PARALLEL_CALLS = (
    "{%- for m in messages %}{%- if m.tool_calls is defined and m.tool_calls and m.tool_calls | length > 1 %}"
    "{{- none + 1 }}{%- endif %}{%- endfor %}"
)

# Refuses what no conversation as written contains: a tool call's markup in the assistant content
# (gpt-oss refuses decoded <|channel|> tags the same way).
REFUSES_CALLS_IN_CONTENT = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and '<tool_call>' in (m.content or '') %}"
    "{{- raise_exception('Pass tool calls in tool_calls, not in content.') }}{%- endif %}{%- endfor %}"
)


def run_suite(tmp_path: pathlib.Path, *options: str) -> dict[str, tuple[str, str]]:
    """Run the packaged tokenization suite in-process; test name -> (outcome, detail)."""
    from agentloop_conformance.cli import ReportCollector

    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    collector = ReportCollector()
    pytest.main(["--pyargs", "agentloop_conformance", "-q", "-p", "no:cacheprovider", "-c", str(ini),
                 "--rootdir", str(tmp_path), "-k", "TestTokenizer", *options], plugins=[collector])
    return {r.nodeid.split("::")[-1]: (r.outcome, r.detail) for r in collector.results.values()}


def template_file(tmp_path: pathlib.Path, prefix: str) -> str:
    path = tmp_path / "chat_template.jinja"
    path.write_text(prefix + chat_template())
    return f"--agentloop-chat-template={path}"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))


def test_a_refused_conversation_skips_with_the_template_message_and_the_rest_run(tmp_path):
    results = run_suite(tmp_path, TINY, template_file(tmp_path, REFUSES_PARALLEL_CALLS))
    parallel = {name: r for name, r in results.items() if "[parallel_tool_calls]" in name}
    others = {name: r for name, r in results.items() if name not in parallel}
    assert len(parallel) == 5, parallel  # every check of the suite
    assert set(parallel.values()) == {("SKIP", f"the chat template refuses this conversation: {REFUSAL}")}, parallel
    assert len(others) > 30, others
    assert {outcome for outcome, _ in others.values()} == {"PASS"}, others


def test_a_template_crash_on_a_conversation_fails(tmp_path):
    results = run_suite(tmp_path, TINY, template_file(tmp_path, CRASHES_ON_PARALLEL_CALLS), "-k", "parallel")
    assert results, results
    assert {outcome for outcome, _ in results.values()} == {"FAIL", "ERROR"}, results
    assert all("TypeError" in detail for _, detail in results.values()), results


def test_a_type_error_in_the_code_under_test_fails(tmp_path):
    results = run_suite(tmp_path, "--agentloop-tokenizer=broken_impls:parallel_calls_crashing_tokenizer",
                        "-k", "parallel")
    assert results, results
    assert {outcome for outcome, _ in results.values()} == {"FAIL", "ERROR"}, results


def test_a_template_that_refuses_generated_markup_in_content_passes(tmp_path):
    # gpt-oss refuses <|channel|> tags in assistant content; this template refuses <tool_call>
    # the same way. The replay never hands the engine's decoded text to the template (deltas
    # and the check render generated turns opaque), so the conversation passes as written.
    results = run_suite(tmp_path, TINY, template_file(tmp_path, REFUSES_CALLS_IN_CONTENT), "-k",
                        "tool_calls_several_rounds")
    assert len(results) == 5, results
    assert {outcome for outcome, _ in results.values()} == {"PASS"}, results

