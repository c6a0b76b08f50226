"""The guard test: a suite test may not be removed or overridden without an xfail reason."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

_GUARD = "test_no_suite_test_removed_or_overridden"


def suite_tests(cls: type) -> dict[str, tuple[type, Any]]:
    """The suite's own tests that ``cls`` inherits: name -> (defining suite class, function).

    Suite classes are those in this package that set ``__conformance_suite__ = True``.
    """
    found: dict[str, tuple[type, Any]] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__dict__.get("__conformance_suite__"):
            continue
        for name, value in klass.__dict__.items():
            if name.startswith("test_") and name != _GUARD and inspect.isfunction(value):
                found[name] = (klass, value)
    return found


def _xfail_reason(obj: Any) -> str | None:
    for mark in getattr(obj, "pytestmark", []) or []:
        if mark.name == "xfail":
            reason = mark.kwargs.get("reason") or (mark.args[1] if len(mark.args) > 1 else "")
            if isinstance(reason, str) and reason.strip():
                return reason
    return None


def guard_violations(cls: type) -> list[str]:
    """Why ``cls`` breaks the guard (empty when it does not)."""
    problems = []
    for name, (suite, original) in sorted(suite_tests(cls).items()):
        current = inspect.getattr_static(cls, name, None)
        if current is original:
            continue
        if current is None or not callable(current):
            problems.append(
                f"{name} (from {suite.__name__}) was removed; keep it and mark it "
                "@pytest.mark.xfail(reason=...) if the implementation cannot pass it"
            )
        elif _xfail_reason(current) is None:
            problems.append(
                f"{name} (from {suite.__name__}) is overridden without @pytest.mark.xfail(reason=...); "
                "an override must say why the standard check does not apply"
            )
    return problems


class SuiteGuard:
    """Mixed into every suite base class."""

    # The async suites mark their whole class for pytest-asyncio; this one sync test does not care.
    @pytest.mark.filterwarnings("ignore:.*is marked with '@pytest.mark.asyncio' but it is not an async function")
    def test_no_suite_test_removed_or_overridden(self) -> None:
        """Every inherited conformance test is still the suite's own, or is marked xfail with a
        reason. Debug: the failure names each test and how it was changed."""
        problems = guard_violations(type(self))
        if problems:
            pytest.fail("conformance tests changed without an xfail reason:\n  " + "\n  ".join(problems))
