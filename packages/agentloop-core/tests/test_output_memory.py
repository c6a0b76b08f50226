"""What an output holds (issue 49 item 5: memory per trajectory; a worker keeps its outputs until
the batch returns): the samples of one prompt share one read-only list of prompt ids, and the
log-probs of tool, user and template tokens one ``0.0``."""

from __future__ import annotations

import copy
import pickle
import tracemalloc

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.shared_ints import ReadOnlyIds
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, Trajectory

TOOL = {"role": "tool", "name": "calc", "tool_call_id": "c0", "content": "5"}


def _outputs(renderer: ChatRenderer, question: str, n: int) -> list:
    """``n`` samples of one prompt, each a generated turn, a tool result and an answer."""
    assert renderer.eos_token_id is not None
    outs = []
    for k in range(n):
        traj = Trajectory(renderer, [{"role": "user", "content": question}], sanity_check="strict")
        for text in ("Let me compute.", f"#### {k}"):
            ids = [*renderer.encode(text), renderer.eos_token_id]
            # Fresh float objects per call, as an engine's tolist() or JSON gives them.
            traj.append_generated(TokenOutput(ids, [float(f"-0.{k + 1}{i}") for i in range(len(ids))]))
            if text.startswith("Let"):
                traj.append_messages([TOOL])
        outs.append(traj.to_output())
    return outs


def test_the_samples_of_one_prompt_share_one_prompt_id_list_that_refuses_changes():
    renderer = ChatRenderer(load_tiny_tokenizer())
    first, second = _outputs(renderer, "What is 2 + 3?", 2)
    ids = first.prompt_ids
    assert second.prompt_ids is ids
    assert isinstance(ids, list)
    assert ids == list(ids)
    for change in (lambda: ids.append(1), lambda: ids.extend([1]), lambda: ids.insert(0, 1), ids.pop, ids.clear,
                   ids.sort, ids.reverse, lambda: ids.remove(ids[0]), lambda: ids.__setitem__(0, 1),
                   lambda: ids.__delitem__(0), lambda: ids.__iadd__([1]), lambda: ids.__imul__(2)):
        with pytest.raises(TypeError, match=r"copy them first: ids = list\(output.prompt_ids\)"):
            change()
    assert second.prompt_ids == list(ids)  # nothing changed
    mine = list(ids)  # a copy is an ordinary list
    mine.append(7)
    assert type(ids[:3]) is list
    assert type(ids + [7]) is list
    assert ids + [7] == mine
    # Pickled together (Ray), the list stays shared and read-only; a deep copy keeps it too.
    a, b = pickle.loads(pickle.dumps([first, second]))
    assert a.prompt_ids is b.prompt_ids
    assert type(a.prompt_ids) is ReadOnlyIds
    assert a.prompt_ids == ids
    assert copy.deepcopy(first).prompt_ids == ids


def test_tool_token_log_probs_are_one_shared_zero_and_the_engines_values_are_kept():
    renderer = ChatRenderer(load_tiny_tokenizer())
    out = _outputs(renderer, "What is 2 + 3?", 1)[0]
    zeros = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 0]
    assert zeros
    assert all(z == 0.0 and z is zeros[0] for z in zeros)
    generated = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 1]
    assert generated[:2] == [-0.10, -0.11]
    assert all(type(x) is float for x in out.response_logprobs)


def _held_per_output(question: str) -> float:
    renderer = ChatRenderer(load_tiny_tokenizer())
    _outputs(renderer, question, 1)  # warm the renderer's caches
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        outs = _outputs(renderer, question, 50)
        held = (tracemalloc.get_traced_memory()[0] - before) / len(outs)
    finally:
        tracemalloc.stop()
    return held


def test_an_outputs_memory_does_not_grow_with_its_shared_prompt():
    """50 samples of a long prompt against 50 of a short one, the same replies: the outputs hold
    the prompt's ids once, so a sample costs well under the 8 bytes per prompt id a copy would."""
    short = "What is 2 + 3?"
    long = short + " Think about it step by step, and use the calculator." * 40
    renderer = ChatRenderer(load_tiny_tokenizer())
    extra_ids = len(renderer.encode(long)) - len(renderer.encode(short))
    assert extra_ids > 400
    grown = _held_per_output(long) - _held_per_output(short)
    assert grown < 8 * extra_ids / 4, f"an output holds {grown:.0f} more bytes for {extra_ids} more prompt ids"
