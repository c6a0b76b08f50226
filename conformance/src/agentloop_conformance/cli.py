"""``agentloop-conformance``: run the suite and print one line per check."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckResult:
    """The outcome of one check."""

    nodeid: str
    """pytest node id."""
    outcome: str
    """PASS, FAIL, SKIP, XFAIL, XPASS or ERROR."""
    detail: str = ""
    """Skip reason or the first line of the failure."""


@dataclass(eq=False)  # hashable: pluggy keeps plugins in sets
class ReportCollector:
    """A pytest plugin object that keeps one :class:`CheckResult` per test."""

    results: dict[str, CheckResult] = field(default_factory=dict)
    turn_kinds: dict[str, str] = field(default_factory=dict)
    """Per agent loop test class: the turn kinds its scripted rollout exercised."""

    def pytest_runtest_logreport(self, report: Any) -> None:
        nodeid = report.nodeid
        for key, value in getattr(report, "user_properties", None) or ():
            if key == "agentloop_turn_kinds" and report.when == "call":
                self.turn_kinds[nodeid.rsplit("::", 1)[0]] = str(value)
        if report.when == "call" or (report.when == "setup" and not report.passed) or \
                (report.when == "teardown" and report.failed):
            self.results[nodeid] = CheckResult(nodeid, *_classify(report))

    def failed(self) -> bool:
        return any(r.outcome in ("FAIL", "ERROR") for r in self.results.values())


def _classify(report: Any) -> tuple[str, str]:
    if hasattr(report, "wasxfail"):
        return ("XFAIL", report.wasxfail) if report.skipped else ("XPASS", report.wasxfail)
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return "SKIP", reason.removeprefix("Skipped: ")
    if report.passed:
        return "PASS", ""
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("E ")]
    first = lines[0][2:].strip() if lines else (text.strip().splitlines() or [""])[-1]
    return ("ERROR" if report.when != "call" else "FAIL"), first


def build_args(ns: argparse.Namespace) -> list[str]:
    args = ["--pyargs", "agentloop_conformance", "-q", "-p", "no:cacheprovider", "--no-header", "-o",
            "asyncio_default_fixture_loop_scope=function",
            "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    for flag, value in (("--agentloop-engine", ns.engine), ("--agentloop-tokenizer", ns.tokenizer),
                        ("--agentloop-chat-template", ns.chat_template), ("--agentloop-loop", ns.loop),
                        ("--agentloop-replies", ns.replies)):
        if value:
            args.append(f"{flag}={value}")
    if ns.k:
        args += ["-k", ns.k]
    return args + list(ns.pytest_args)


def main(argv: list[str] | None = None) -> int:
    """Run the conformance suite; exit status 1 when a check fails, 2 on usage errors."""
    parser = argparse.ArgumentParser(
        prog="agentloop-conformance",
        description="Run the agentloop conformance suite against an engine, a tokenizer and/or an agent loop.")
    parser.add_argument("--engine", help="pkg.module:factory returning an engine or an EngineTarget")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer folder (or pkg.module:factory)")
    parser.add_argument("--chat-template", help="Jinja chat template file replacing the tokenizer's own")
    parser.add_argument("--loop", help="pkg.module:factory, a callable (server) -> AgentLoopBase")
    parser.add_argument("--replies", help="JSON file (list of texts) or pkg.module:attr: what the scripted engine "
                                          "says to the loop (default: turns scripted from its declared tools)")
    parser.add_argument("-k", help="only checks matching this pytest -k expression")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    ns = parser.parse_args(argv)
    if not (ns.engine or ns.tokenizer or ns.loop):
        parser.error("give at least one of --engine, --tokenizer, --loop")

    import pytest

    collector = ReportCollector()
    code = pytest.main(build_args(ns), plugins=[collector])
    results = list(collector.results.values())
    width = max((len(r.nodeid) for r in results), default=0)
    print("\nagentloop conformance report")
    for r in results:
        name = r.nodeid.split("::", 1)[-1]
        line = f"{r.outcome:<5} {name:<{width}}"
        print(line + (f"  {r.detail}" if r.detail else "") if r.detail else line.rstrip())
    counts = {k: sum(r.outcome == k for r in results) for k in ("PASS", "FAIL", "ERROR", "SKIP", "XFAIL", "XPASS")}
    print(", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v))
    for where, summary in collector.turn_kinds.items():
        print(f"turn kinds ({where.split('::', 1)[-1]}): {summary}")
    if collector.failed():
        return 1
    return 0 if code in (0, 5) or not results else int(code)


if __name__ == "__main__":
    sys.exit(main())
