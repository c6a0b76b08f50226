"""A trajectory in flight keeps its mask as bytes and its log-probs as doubles (issue 49: with
thousands in flight, a list of float objects cost 32 bytes per token, a list of mask ints 8);
its output still gets plain lists, and the values are the engine's exactly."""

from __future__ import annotations

import sys
import tracemalloc

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, Trajectory

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
TOOL = {"role": "tool", "name": "calc", "tool_call_id": "c0", "content": "5"}


def _turn(renderer: ChatRenderer, text: str, first_lp: float) -> TokenOutput:
    assert renderer.eos_token_id is not None
    ids = [*renderer.encode(text), renderer.eos_token_id]
    return TokenOutput(ids, [first_lp - 1e-3 * i for i in range(len(ids))])


def test_the_output_gets_the_engines_log_probs_exactly_as_lists():
    renderer = ChatRenderer(load_tiny_tokenizer())
    traj = Trajectory(renderer, PROMPT, sanity_check="strict")
    first, second = _turn(renderer, "Calling the tool.", 0.1 + 0.2), _turn(renderer, "#### 5", -1 / 3)
    traj.append_generated(first)
    glue = traj.append_messages([TOOL])
    traj.append_generated(second)
    out = traj.to_output()
    assert type(out.response_mask) is list
    assert type(out.response_logprobs) is list
    assert type(out.response_ids) is list
    assert isinstance(out.prompt_ids, list)  # a read-only list shared by the prompt's samples
    assert out.response_mask == [1] * len(first.token_ids) + [0] * len(glue) + [1] * len(second.token_ids)
    assert out.response_logprobs == [*first.log_probs, *[0.0] * len(glue), *second.log_probs]  # doubles: exact
    assert all(type(x) is float for x in out.response_logprobs)


def _grown_per_trajectory(renderer: ChatRenderer, outputs: list[TokenOutput], logprobs: bool) -> tuple[float, int]:
    """Bytes each of 200 trajectories grows by over two more tool turns, and the ids it gained."""
    trajs = [Trajectory(renderer, PROMPT, sanity_check="disable") for _ in range(200)]
    for traj in trajs:  # warm every path (and the first turn's lists) before measuring
        traj.append_generated(outputs[0] if logprobs else TokenOutput(list(outputs[0].token_ids)))
    start = len(trajs[0].response_ids)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for traj in trajs:
            for out in outputs[1:]:
                traj.append_messages([TOOL])
                # Fresh float objects per call, as an engine's tolist() or JSON gives them.
                lps = [float(f"{x}1") for x in out.log_probs] if logprobs and out.log_probs else None
                traj.append_generated(TokenOutput(list(out.token_ids), lps))
        grown = (tracemalloc.get_traced_memory()[0] - before) / len(trajs)
    finally:
        tracemalloc.stop()
    traj = trajs[0]
    assert sys.getsizeof(traj.response_mask) < 2 * len(traj.response_ids) + 64  # a byte per id (and slack)
    return grown, len(traj.response_ids) - start


def test_a_trajectory_in_flight_holds_its_log_probs_in_8_bytes_a_token():
    """The engine's log-prob floats are not kept: what log-probs add to a trajectory in flight
    is the doubles (8 bytes a token, plus the array's slack), where a list of float objects
    cost 32 (a pointer and a 24-byte float)."""
    renderer = ChatRenderer(load_tiny_tokenizer())
    text = "Let me compute that with the calculator tool right now, step by step."
    outputs = [_turn(renderer, text, -0.5) for _ in range(3)]
    with_lp, ids = _grown_per_trajectory(renderer, outputs, logprobs=True)
    without, same = _grown_per_trajectory(renderer, outputs, logprobs=False)
    assert ids == same > 60
    assert (with_lp - without) / ids < 16
