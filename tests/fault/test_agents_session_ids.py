"""Session ids from row indexes (issue #31, class 5).

``http_agent`` built a trajectory's session id from the row's ``index``: an index with ``/``
(MATH's ``test/algebra/1.json``) failed every sample of its row, and an index of 188+ characters
truncated away the part that made the id unique, so the samples of a group shared one session.
Now every sample gets a valid id of its own whatever the index, and the index is recorded in
the output's ``extra_fields["row_index"]``.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason='http_agent tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.runtime import AgentLoopWorker  # noqa: E402
from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_engines.serving.gateway.recorder import check_session_id  # noqa: E402
from agentloop_engines.serving.http_agent import close_gateways  # noqa: E402

SAMPLING = {"temperature": 1.0, "max_tokens": 4}
GROUP = 3
LONG = "x" * 188
INDEXES = [
    "test/algebra/1.json",  # MATH
    "../../etc/passwd",
    "a?b=1&c=%2F#frag",
    "100%",
    "ünïcødé/数学/😀",
    "with space and\ttab\nnewline",
    "",
    LONG + "-first",  # two rows whose indexes differ only after 188 characters
    LONG + "-second",
    "y" * 10_000,
    7,
    -1.5,
    None,
    ("tuple", 3),
    {"split": "test", "id": 1},
]


def agent(base_url: str, row: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    client.chat.completions.create(model="any", messages=row["raw_prompt"])
    return 1.0


@pytest.fixture(autouse=True)
def _stop_gateways():
    yield
    close_gateways()


async def test_every_sample_of_every_index_gets_its_own_valid_session(tokenizer):
    server = ScriptedServer(lambda rid, prompt, k: [5, 6, 7])
    worker = AgentLoopWorker(server, tokenizer, {"agent_loop_configs": {"http_agent": {"agent": agent}},
                                                 "sampling_params": SAMPLING})
    rows = [{"index": index, "agent_name": "http_agent", "raw_prompt": [{"role": "user", "content": "hi"}]}
            for index in INDEXES for _ in range(GROUP)]
    outputs = await worker.generate_sequences(rows)
    failed = [(rows[o.trajectory_index]["index"], o.metrics.get("error")) for o in outputs if o.failed]
    assert not failed, f"{len(failed)} of {len(rows)} samples failed, e.g. {failed[:3]}"
    ids = [o.extra_fields["session_id"] for o in outputs]
    assert len(set(ids)) == len(rows), "two samples shared a session"
    for session_id in ids:
        assert check_session_id(session_id) == session_id
    # One engine request id per session, each of them one sample's.
    assert len({call.request_id for call in server.calls}) == len(rows)
    # The index is still there for the user, as it was.
    for output in outputs:
        assert output.extra_fields["row_index"] == rows[output.trajectory_index]["index"]
    # A readable prefix where the index has one.
    math = [o.extra_fields["session_id"] for o in outputs if rows[o.trajectory_index]["index"] == INDEXES[0]]
    assert all(s.startswith("test_algebra_1.json-") for s in math)
