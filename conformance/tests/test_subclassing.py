"""The README's subclassing pattern keeps working under pytest's deprecations: class-scoped
fixtures that override ``engine``/``tokenizer`` are classmethods (sync and async), and an
instance-method one is what the inner run's ``filterwarnings`` turns into an error."""

from __future__ import annotations

SUBCLASSES = """
    import pytest
    import pytest_asyncio

    from agentloop_conformance import EngineConformanceTests
    from agentloop_conformance.tokenization import TokenizationConformanceTests
    from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer

    class TestSyncEngine(EngineConformanceTests):
        @pytest.fixture(scope="class")
        @classmethod
        def engine(cls):
            yield ScriptedServer()

    class TestAsyncEngine(EngineConformanceTests):
        @pytest_asyncio.fixture(scope="class", loop_scope="class")
        @classmethod
        async def engine(cls):
            yield ScriptedServer()

    class TestClassTokenizer(TokenizationConformanceTests):
        @pytest.fixture(scope="class")
        @classmethod
        def tokenizer(cls):
            return load_tiny_tokenizer()

    class TestInstanceMethodEngine(EngineConformanceTests):
        @pytest.fixture(scope="class")
        def engine(self):
            yield ScriptedServer()
"""


def test_classmethod_fixtures_override_the_suite_without_a_deprecation(pytester):
    # The inner run does not see the repo's pytest settings; the deprecation is made an error
    # as it is where filterwarnings = error.
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
                     "filterwarnings =\n    error::pytest.PytestRemovedIn10Warning\n")
    pytester.makepyfile(test_subclasses=SUBCLASSES)
    reprec = pytester.inline_run("-p", "no:cacheprovider", "-k", "greedy_is_deterministic or masks_align")
    outcomes: dict[str, set[str]] = {}
    for report in reprec.getreports("pytest_runtest_logreport"):
        if report.when in ("setup", "call") and (report.when == "call" or report.outcome != "passed"):
            outcomes.setdefault(report.nodeid.split("::")[1], set()).add(report.outcome)
    assert outcomes.pop("TestInstanceMethodEngine") == {"failed"}, "the instance-method fixture should error"
    assert outcomes == {"TestSyncEngine": {"passed"}, "TestAsyncEngine": {"passed"},
                        "TestClassTokenizer": {"passed"}}, outcomes
