"""What a trajectory in flight holds (issue 49 item 5: memory per trajectory at 4096 concurrent):
token ids share one int object per value, and a paced turn lets go of its prompt while it
waits for its slot."""

from __future__ import annotations

import asyncio
import tracemalloc
import weakref

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.runtime.pacing import PacedServer, TurnPacer
from agentloop_core.shared_ints import MAX_SHARED_ID, shared_ids
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.tokenization import ChatRenderer, Trajectory
from agentloop_core.tokenization.incremental import Digests, snapshot


def fresh(values: list[int]) -> list[int]:
    """The values as new int objects, as an engine's ``tolist()`` or a JSON reply returns them."""
    return [int(str(v)) for v in values]


def test_shared_ids_returns_an_equal_new_list_whose_ids_are_one_object_per_value():
    values = [300, 70_000, 5, 300, 151_643]
    a, b = fresh(values), fresh(values)
    assert a[0] is not b[0]  # the precondition: fresh objects
    shared_a, shared_b = shared_ids(a), shared_ids(b)
    assert shared_a == shared_b == values
    assert type(shared_a) is list
    assert shared_a is not a
    assert all(x is y for x, y in zip(shared_a, shared_b, strict=True))
    assert shared_a[0] is shared_a[3]
    assert shared_ids(iter(fresh(values))) == values  # any iterable, e.g. a tuple from a cache


@pytest.mark.parametrize("ids", [[], [3, -1, 400], [-1, 5000], [1.0, 2], [5000, 2.5], [MAX_SHARED_ID + 1, 4], [None, 4]])
def test_shared_ids_copies_what_it_cannot_share_unchanged(ids):
    out = shared_ids(ids)
    assert out == ids
    assert out is not ids
    assert [type(x) for x in out] == [type(x) for x in ids]


def test_shared_ids_gives_other_integers_as_the_plain_int_of_their_value():
    out = shared_ids([True, 2])
    assert out == [1, 2]
    assert [type(x) for x in out] == [int, int]


def test_a_trajectory_stores_shared_ids_from_the_engine_and_the_renderer():
    renderer = ChatRenderer(load_tiny_tokenizer())
    generated = fresh(renderer.encode("The answer is 42.")) + [renderer.tokenizer.eos_token_id]
    trajectories = [Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}]) for _ in range(2)]
    for traj in trajectories:
        traj.append_generated(TokenOutput(token_ids=fresh(generated), log_probs=[-0.5] * len(generated)))
        traj.append_messages([{"role": "user", "content": "Thanks."}])
    first, second = trajectories
    assert first.response_ids == second.response_ids
    assert any(i > 256 for i in first.response_ids)  # ids CPython does not cache on its own
    assert all(x is y for x, y in zip(first.response_ids, second.response_ids, strict=True))
    assert all(x is y for x, y in zip(first.prompt_ids, second.prompt_ids, strict=True))
    out = first.to_output()
    assert out.response_ids == first.response_ids
    assert out.response_mask.count(1) == len(generated)


class _Ids(list):
    """A list a weak reference can watch."""


class _Engine:
    async def generate(self, request_id, prompt_ids, sampling_params=None, **multi_modal):
        return TokenOutput(token_ids=[1], stop_reason="stop")


async def test_a_paced_turn_lets_go_of_its_prompt_while_it_waits_for_its_slot():
    pacer = TurnPacer(0)  # lets nobody through: the turn stays queued after the engine returned
    prompt = _Ids([5, 6, 7])
    watch = weakref.ref(prompt)
    task = asyncio.create_task(PacedServer(_Engine(), pacer).generate("r", prompt))
    del prompt
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()
    assert len(pacer._waiters) == 1
    assert watch() is None, "the queued turn still holds the whole context it sent to the engine"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_shared_ids_grows_its_table_to_a_large_vocabulary_and_keeps_every_value():
    ids = fresh([262_143, 131_072 + 7, 0, 256, 257])  # Gemma's vocabulary is 262,144 ids
    assert shared_ids(ids) == ids
    assert shared_ids(fresh([262_143]))[0] is shared_ids(fresh([262_143]))[0]


def _grown_by_one_turn(renderer: ChatRenderer, ids: list[int], stop_reason: str) -> float:
    """Bytes each of 50 trajectories grows by when one generated turn of ``ids`` is appended."""
    trajectories = [Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}]) for _ in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for traj in trajectories:
            traj.append_generated(TokenOutput(token_ids=list(ids), log_probs=[-0.5] * len(ids), stop_reason=stop_reason))
        return (tracemalloc.get_traced_memory()[0] - before) / len(trajectories)
    finally:
        tracemalloc.stop()


def test_a_generated_turn_holds_its_text_once():
    """The assistant message's content and the check's text of the turn are one string: a turn
    that ended on a stop token used to be held twice (with and without the token's text)."""
    renderer = ChatRenderer(load_tiny_tokenizer())
    reply = "The answer, worked out step by step, is forty-two. " * 40
    ids = [*renderer.encode(reply), renderer.tokenizer.eos_token_id]
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}])
    traj.append_generated(TokenOutput(token_ids=list(ids), log_probs=[-0.5] * len(ids)))
    assert traj.messages[-1]["content"] == reply
    assert traj._pieces[-1].text == renderer.decode(ids)  # what the check reads is unchanged
    # Against a turn cut by its length (no stop token: its content is its whole text, held once
    # before and after) one id shorter, an ended turn adds nothing like its text again.
    ended = _grown_by_one_turn(renderer, ids, "stop")
    cut = _grown_by_one_turn(renderer, ids[:-1], "length")
    assert ended - cut < len(reply) / 2, f"an ended turn of {len(reply)} characters costs {ended - cut:.0f} bytes more"


def _grown_by_appending(renderer: ChatRenderer, message: dict, preview: bool) -> tuple[float, int]:
    """Bytes each of 20 trajectories with one generated turn grows by when ``message`` is
    appended (previewed first when ``preview``), and the ids that appended."""
    answer = [*renderer.encode("Let me look that up."), renderer.tokenizer.eos_token_id]
    trajectories = [Trajectory(renderer, [{"role": "user", "content": "What is 6*7?"}]) for _ in range(20)]
    for traj in trajectories:
        traj.append_generated(TokenOutput(token_ids=list(answer), log_probs=[-0.5] * len(answer)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for traj in trajectories:
            if preview:
                traj.preview_messages([message])
            n_ids = len(traj.append_messages([message]))  # the returned copy is dropped at once
        return (tracemalloc.get_traced_memory()[0] - before) / len(trajectories), n_ids
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("preview", [False, True])
def test_appended_messages_hold_their_ids_once_while_the_next_turn_waits(preview):
    """After ``append_messages`` the trajectory holds the delta's ids in ``response_ids`` only:
    the last delta (kept so that a preview followed by its append renders once) used to stay
    beside them, a second list of every appended id while the next turn waited for the engine."""
    renderer = ChatRenderer(load_tiny_tokenizer())
    message = {"role": "tool", "content": "row 17: 4.25 m, 18.1 kg, ok; " * 80}
    grown, n_ids = _grown_by_appending(renderer, message, preview)
    assert n_ids > 1000
    # Per id: 8 bytes in response_ids, 8 in the log-probs, 1 in the mask (growth included);
    # the rendered text once (one byte per character here); a fixed cost for the piece, the
    # digests and the message's own dict. A second list of the ids is 8 bytes per id more.
    bound = 17 * n_ids * 1.15 + len(message["content"]) * 1.1 + 2000
    assert grown < bound, f"appending {n_ids} ids cost {grown:.0f} bytes, more than {bound:.0f}"


def test_message_digests_are_packed_and_read_back_as_taken():
    """A trajectory's message digests (one per message, the check's proof that none changed)
    are 16 bytes each in one buffer, not a bytes object and a list slot (~64 bytes) each."""
    messages = [{"role": "tool", "content": f"result {i}"} for i in range(2000)]
    taken = [snapshot(m) for m in messages]
    taken[7] = None  # a message that is not JSON (an image): nothing to compare it by
    tracemalloc.start()
    try:
        digests = Digests(taken[:1000])
        digests.extend(taken[1000:1500])
        for d in taken[1500:]:
            digests.append(d)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert list(digests) == taken
    assert len(digests) == 2000
    assert held < 20 * len(taken), f"{held / len(taken):.1f} bytes per digest"
    with pytest.raises(ValueError, match="16 bytes from snapshot"):
        digests.append(b"short")
    with pytest.raises(ValueError, match="16 bytes from snapshot"):
        digests.append("x" * 16)  # type: ignore[arg-type]
