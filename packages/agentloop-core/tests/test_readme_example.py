"""The custom-loop example in the root README runs as written."""

import re
from pathlib import Path

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer

README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.mark.skipif(not README.exists(), reason="the root README is not beside this package (installed alone)")
async def test_readme_custom_loop_example_runs():
    match = re.search(r"```python\n((?:import [^\n]*\n\n?)*from agentloop_core import .*?)```", README.read_text(), re.S)
    assert match, "the README's contract example (a python block importing from agentloop_core) is gone"
    code = match.group(1)
    namespace: dict = {}
    exec(compile(code.replace('@register("my_agent")', '@register("readme_my_agent")'), str(README), "exec"), namespace)
    tok = load_tiny_tokenizer()
    replies = [tok.encode("Four.", add_special_tokens=False), tok.encode("Yes, four.", add_special_tokens=False)]
    server = ScriptedServer(replies, eos_token_id=tok.eos_token_id, append_eos=True)
    loop = namespace["MyAgent"](server, tok)
    out = await loop.run(
        {"max_tokens": 16},
        raw_prompt=[{"role": "user", "content": "What is 2 + 2?"}],
        request_id="r1",
    )
    generated = [t for call in server.calls for t in call.output.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1] == generated
    assert out.reward_score == 1.0
    assert 0 in out.response_mask
    assert server.calls[1].prompt_ids == out.prompt_ids + out.response_ids[: len(server.calls[1].prompt_ids) - len(out.prompt_ids)]
