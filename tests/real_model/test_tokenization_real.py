"""(a) Tokenization on the real tokenizers: the conformance suite on the tool-aware copy (every
conversation) and on the checkpoint's own template, and a calculator trajectory built the way
the ``tool_agent`` loop builds it, held to the strict sanity check; for SmolLM2 (a 49152-token
byte-level BPE, ChatML + ``chatml-hermes``) and Gemma 3 (a 262144-token SentencePiece-style BPE
with byte fallback, ``gemma-hermes``, which its fetched folder carries as its own).

A failure here means delta tokenization does not reproduce a full re-tokenization with a real
vocabulary that the tiny tokenizer never exercised (SmolLM2's merges across ``\\n`` after
``<|im_end|>``, its digit splitting; Gemma's runs of spaces and newlines as single tokens): read
the text around the first differing token.
"""

from __future__ import annotations

import json

import pytest
from real_model_helpers import calculator_prompts, calculator_tools, report

from agentloop_conformance.tokenization import TokenizationConformanceTests
from agentloop_core.protocol import TokenOutput
from agentloop_core.tokenization import ChatRenderer, Trajectory


class TestToolAwareTokenizerConformance(TokenizationConformanceTests):
    """Every conversation (tool calls over several rounds included) on the tool-aware copy."""

    @pytest.fixture
    def tokenizer(self, tool_tokenizer):
        return tool_tokenizer


class TestOwnTemplateConformance(TokenizationConformanceTests):
    """The checkpoint's own template: SmolLM2's plain ChatML that drops ``tools=`` (tool messages
    render as ChatML turns of their role), Gemma's fetched ``gemma-hermes``; the suite holds for both."""

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, model_dir):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))


def hermes_call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


@pytest.mark.parametrize(("expression", "result"), [("12 * 7 - 3", "81"), ("(4 + 5) / 2", "4.5")])
def test_calculator_trajectory_strict(tool_tokenizer, real_model, expression, result):
    """Two generated turns (a hermes call, then ``#### N``) around a tool result appended as a
    template delta: the strict check equals one tokenization of the whole conversation, the
    generated ids stay mask 1 in order, and the tool result is mask 0."""
    renderer = ChatRenderer(tool_tokenizer, tools=calculator_tools())
    messages = calculator_prompts(1, seed=5)[0]
    traj = Trajectory(renderer, messages, sanity_check="strict")
    assert "<tools>" in renderer.decode(traj.prompt_ids), "the tool-aware template must render the schemas"
    eos = tool_tokenizer.convert_tokens_to_ids(real_model.end_of_turn)
    generated = []
    for text in (hermes_call(expression), f"#### {result}"):
        ids = tool_tokenizer.encode(text, add_special_tokens=False) + [eos]
        generated.append(ids)
        traj.append_generated(TokenOutput(token_ids=ids, log_probs=[-0.01] * len(ids), stop_reason="stop"))
        if text.startswith("<tool_call>"):
            traj.append_messages([{"role": "tool", "name": "calculator", "content": result}])
    report = traj.sanity_check("strict")
    assert report.ok, report
    mask_1 = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 1]
    assert mask_1 == generated[0] + generated[1]
    tool_part = renderer.decode([t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 0])
    assert f"<tool_response>\n{result}\n</tool_response>" in tool_part
    # One render of the finished conversation gives the same ids.
    final = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"#### {result}"},
    ]
    text = tool_tokenizer.apply_chat_template(final, tools=calculator_tools(), tokenize=False)
    assert traj.context_ids == tool_tokenizer.encode(text.removesuffix("\n"), add_special_tokens=False)


def test_core_tokenization_suite_on_the_real_tokenizer(model_dir, tool_tokenizer, tool_tokenizer_dir, tmp_path):
    """The core package's tokenization tests (delta vs full tokenization, hypothesis-generated
    unicode/whitespace contents, tool turns) and its built-in template tests (tools, calls and
    results rendered; the multi-turn tool trajectory under the strict sanity check) on the
    checkpoint's folder and on the tool-aware copy (Gemma's folder is its own tool-aware copy),
    with each built-in whose turn markers the vocabulary has, through their
    ``AGENTLOOP_TOKENIZER_DIRS`` hook, in a subprocess of their own.

    SmolLM2's vocabulary lacks 21 of the 256 byte-level symbols (0xC0, 0xC1, 0xF1,
    0xF2, 0xF5-0xFF and some control bytes), so a character whose UTF-8 uses one (planes 4-12,
    e.g. U+40000) encodes lossily ([218, 218, 218], decoding to three U+FFFD); hypothesis finds
    such characters, and the core test counts ids whose decoded text re-encodes differently as
    non-canonical, as the sanity check does. The database lives in ``tmp_path`` so a failure
    found elsewhere is not replayed here.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[2] / "packages" / "agentloop-core" / "tests"
    suites = [tests / "test_tokenization.py", tests / "test_builtin_templates.py"]
    if not all(suite.is_file() for suite in suites):
        pytest.skip(f"{tests} is not in this checkout (an installed package without its tests)")
    own = Path(model_dir) / "chat_template.jinja"
    own_is_tool_aware = own.is_file() and own.read_text(encoding="utf-8") == tool_tokenizer.chat_template
    folders = [Path(model_dir)] if own_is_tool_aware else [Path(model_dir), Path(tool_tokenizer_dir)]
    env = {**os.environ, "AGENTLOOP_TOKENIZER_DIRS": ":".join(map(str, folders))}
    proc = subprocess.run([sys.executable, "-m", "pytest", *map(str, suites), "-q", "-p", "no:cacheprovider", "-rs",
                           "-k", " or ".join(f.name for f in folders)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report(f"core tokenization tests on {[f.name for f in folders]}: {summary}")
    assert " passed" in summary, summary
    assert "failed" not in summary, summary
    # The tool-aware copy renders tools=, so its tool tests run instead of skipping.
    skipped_tool_tests = [line for line in proc.stdout.splitlines()
                          if line.startswith("SKIPPED") and "does not render tools" in line]
    assert len(skipped_tool_tests) <= 1, skipped_tool_tests
