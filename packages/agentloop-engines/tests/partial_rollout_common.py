"""Constants and helpers of the partial-rollout tests on real engines
(``test_partial_rollout_hf.py``, ``test_partial_rollout_http.py``, ``test_partial_rollout_ray.py``);
the tiny model and its old and new weights are fixtures in ``conftest.py``.

torch and transformers are imported inside the helpers that use them: the Ray test imports this
module without the hf extra.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

PROMPT = [100, 200, 300, 17, 5]
MAX_TOKENS = 96
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
LOGPROB_TOL = 1e-4
HANG_S = 120  # a wait this long means a hang, never a slow machine


def max_abs(a: list[float], b: list[float]) -> float:
    """The largest ``|a[i] - b[i]|`` (0 for empty lists); the lists must be equally long."""
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def scorer(model_path: Any, weights: dict[str, Any]) -> Callable[..., list[float]]:
    """``score(prompt, generated, temperature=0.0)``: each generated token's log-prob under
    ``weights`` by a plain forward pass over prompt + generated ids (what a trainer computes;
    greedy scores at T=1)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights)

    def score(prompt: list[int], generated: list[int], temperature: float = 0.0) -> list[float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + generated])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0), dim=-1)
        return lp.gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()

    return score


async def wait_for_tokens(engines: Sequence[Any], request_id: str, at_least: int, task: asyncio.Future) -> int:
    """Wait until an ``HFServer`` row for ``request_id`` holds ``at_least`` tokens and return its
    count (engine internals: a caller sees tokens only when the request ends). The rows are
    copied before reading: over HTTP the engines run on their server threads' loops."""
    while True:
        if task.done():
            raise AssertionError(f"{request_id} ended before the update: {task.result()}")
        rows = [r for e in engines for r in list(e._by_id.get(request_id, ())) if not r.done]
        if rows and len(rows[0].token_ids) >= at_least:
            return len(rows[0].token_ids)
        await asyncio.sleep(0.001)
