"""``session_id_for``: a valid, distinct session id for every sample of any row index."""

from __future__ import annotations

import pytest

from agentloop_engines.serving.gateway.recorder import check_session_id
from agentloop_engines.serving.http_agent import session_id_for


@pytest.mark.parametrize("index", ["test/algebra/1.json", "a?b%2F", "数学/😀", "\ud800", "", " ", "z" * 10_000,
                                   0, 7, -1.5, float("nan"), None, True, (1, "a"), {"k": [1]}, b"bytes"])
def test_any_index_gives_valid_distinct_ids(index):
    ids = {session_id_for(index) for _ in range(50)}
    assert len(ids) == 50
    for session_id in ids:
        assert check_session_id(session_id) == session_id
        assert len(session_id) <= 63


def test_the_readable_prefix_and_the_digest():
    assert session_id_for("test/algebra/1.json").startswith("test_algebra_1.json-")
    assert session_id_for(7).startswith("7-")
    assert session_id_for(None).startswith("row-")
    # Indexes that agree on every readable character still differ in the digest.
    long = "q" * 300
    a, b = session_id_for(long + "a").split("-"), session_id_for(long + "b").split("-")
    assert a[0] == b[0]
    assert a[1] != b[1]
    # The samples of one row share the readable part and the digest; only the random part differs.
    first, second = session_id_for("row/1").split("-"), session_id_for("row/1").split("-")
    assert first[:2] == second[:2]
    assert first[2] != second[2]
    # 7 and "7" are different rows.
    assert session_id_for(7).split("-")[1] != session_id_for("7").split("-")[1]
