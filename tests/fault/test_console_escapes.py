"""Text from models, tools and model files reaches the terminal escaped: an ``ESC]0;`` title, an
``ESC[2J`` screen clear, a ``\\r`` that overwrites a status line, a one-byte C1 CSI or a bidi
override in a tool's error, a sample's failure or a GGUF's metadata is printed as visible
``\\x1b`` / ``\\u202e`` text; ``\\n`` and ``\\t`` stay.

How to debug a failure: every console path goes through ``agentloop_core.console.console_safe``
(the CLI's log function ``cli.main._log``, ``rollout.diagnostics.report_failures``, the model
command's messages, and logging through ``install_console_logging`` in ``cli.main.main``). A raw
``\\x1b`` in the captured output names the path that skipped it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentloop_core.console import RAW_ENV, console_safe

pytest.importorskip("agentloop_trainer", reason="the CLI is agentloop-trainer's")

HOSTILE = ("\x1b]0;pwned\x07\x1b[2J\x1b[H\rstep 100/100 reward 1.000 OK\x9b31m"
           "\u202etxt.exe\u2066x\u2069\x00\x7f tab\there\nnext line")
UNSAFE = {*map(chr, [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]),
          *"\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"}


def _raw(text: str) -> set[str]:
    return {c for c in text if c in UNSAFE}


@given(st.text())
def test_console_safe_leaves_no_character_a_terminal_obeys(text):
    """Over any unicode text: no C0/C1 control (but \\n, \\t), DEL or bidi control survives; the
    rest is unchanged (a string without them comes back equal)."""
    out = console_safe(text)
    assert not _raw(out)
    assert out.count("\n") == text.count("\n")
    assert out.count("\t") == text.count("\t")
    if not _raw(text):
        assert out == text


def test_console_safe_shows_what_it_escaped():
    out = console_safe(HOSTILE)
    assert out.startswith("\\x1b]0;pwned\\x07\\x1b[2J\\x1b[H\\x0dstep 100/100")
    assert "\\x9b31m" in out
    assert "\\u202etxt.exe\\u2066x\\u2069\\x00\\x7f" in out
    assert "tab\there\nnext line" in out


def test_the_cli_log_and_failure_report_escape_model_and_tool_text(capsys):
    """The trainer's log function (every progress and warning line of ``agentloop train``) and the
    failure report of ``agentloop eval`` / ``rollout``, given a tool error carrying escapes."""
    from agentloop_trainer.cli.main import _log
    from agentloop_trainer.rollout.diagnostics import report_failures

    _log(f"WARNING: every reward is 0; a generated response: {HOSTILE}")
    assert report_failures([f"tool 'calc' raised: {HOSTILE}"] * 2, 4, "eval", print) == 0
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert not _raw(printed), sorted(_raw(printed))
    assert "\\x1b]0;pwned" in printed


def test_warnings_logged_in_the_cli_are_escaped():
    """In a fresh ``agentloop`` process (no logging configured): a ``logger.warning`` that quotes
    a tool's exception text, as the tool loop does, reaches stderr escaped; with
    ``AGENTLOOP_CONSOLE_RAW=1`` (the documented opt-out) it is printed as it is."""
    script = textwrap.dedent(f"""
        import logging
        from agentloop_trainer.cli.main import main
        main(["model", "list"])
        logging.getLogger("agentloop_tools.agent_loop").warning("tool %r release failed: %s", "calc", {HOSTILE!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != RAW_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "release failed" in done.stderr
    assert not _raw(done.stderr), sorted(_raw(done.stderr))
    raw = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**env, RAW_ENV: "1"})
    assert "\x1b]0;pwned" in raw.stderr


def test_gguf_metadata_quoted_by_the_model_command_is_escaped(tmp_path, capsys):
    """``agentloop model convert`` on a GGUF whose architecture name carries escapes: the one
    error line quotes it escaped (a model file is as hostile as model output)."""
    pytest.importorskip("gguf", reason='GGUF conversion needs gguf: pip install "agentloop-trainer[gguf]"')
    pytest.importorskip("accelerate", reason='GGUF conversion needs accelerate: pip install "agentloop-trainer[gguf]"')
    import struct

    from agentloop_trainer.cli.main import main

    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    arch = "llama\x1b]0;pwned\x07\x1b[2J\u202e"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("general.architecture") + struct.pack("<I", 8) + s(arch)
    path = tmp_path / "x.gguf"
    path.write_bytes(head + b"\0" * (-len(head) % 32))
    assert main(["model", "convert", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "agentloop model convert:" in err
    assert not _raw(err), sorted(_raw(err))
    assert "\\x1b]0;pwned" in err
