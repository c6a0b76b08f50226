"""The trainer (``RolloutConfig.with_loop_configs``, at start-up) checks every per-loop section of a user's config against the loop's config class
before any rollout: a typo in a ``tool_agent`` or ``react_agent`` section is an error naming the
closest key, not a setting silently ignored."""

from __future__ import annotations

import pytest

pytest.importorskip("agentloop_trainer", reason="needs agentloop-trainer (nox -s integration)")
pytest.importorskip("agentloop_langgraph", reason="needs agentloop-langgraph (nox -s integration)")

from agentloop_core.settings import RolloutConfig  # noqa: E402


def test_valid_sections_of_both_tool_loops_pass():
    RolloutConfig().with_loop_configs({
        "tool_agent": {"max_assistant_turns": 3, "max_user_turns": 2, "delta_strategy": "short"},
        "react_agent": {"max_parallel_calls": 2, "recursion_limit": 10, "graph_factory": None},
    })


@pytest.mark.parametrize(("loop", "typo", "closest"), [
    ("tool_agent", "max_assistant_turn", "max_assistant_turns"),
    ("tool_agent", "delta_stratgy", "delta_strategy"),
    ("react_agent", "max_paralel_calls", "max_parallel_calls"),
    ("react_agent", "graph_factory_kwarg", "graph_factory_kwargs"),
])
def test_a_typo_in_a_loop_section_names_the_closest_key(loop, typo, closest):
    with pytest.raises(ValueError, match=rf"{loop} config has unknown keys '{typo}' \(did you mean '{closest}'\?\)"):
        RolloutConfig().with_loop_configs({loop: {typo: 1}})
