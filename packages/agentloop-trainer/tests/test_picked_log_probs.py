"""Chunked target log-probs (``update/picked_log_probs.py``): the plain float32 computation's
values and gradients, chunk boundaries, temperature and unscored trailing positions included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentloop_trainer.update import picked_log_probs as module  # noqa: E402
from agentloop_trainer.update.picked_log_probs import picked_log_probs  # noqa: E402
from agentloop_trainer.update.placeholder_mask import token_log_probs  # noqa: E402


def plain(logits, targets, temperature):
    """What the trainer computed before: the whole tensor cast to float32, then gather - logsumexp."""
    x = logits[..., : targets.shape[-1], :].float()
    if temperature != 1.0:
        x = x / temperature
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("extra", [0, 1, 3])
@pytest.mark.parametrize("chunk", ["3 positions", "2 rows", "everything"])
def test_values_and_gradients_are_the_plain_computations(dtype, temperature, extra, chunk, monkeypatch):
    B, n, V = 5, 10, 97
    # 3 positions a chunk: full and partial chunks within a row; 2 whole rows a chunk: the last
    # chunk holds one row; the default: one chunk.
    size = {"3 positions": 3 * 4 * V, "2 rows": 2 * n * 4 * V, "everything": module.CHUNK_BYTES}[chunk]
    monkeypatch.setattr(module, "CHUNK_BYTES", size)
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(B, n + extra, V, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, V, (B, n), generator=gen)
    weights = torch.randn(B, n, generator=gen)
    got_x = base.clone().requires_grad_(True)
    want_x = base.clone().requires_grad_(True)
    got, want = picked_log_probs(got_x, targets, temperature), plain(want_x, targets, temperature)
    assert got.dtype == torch.float32
    assert got.shape == (B, n)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert got_x.grad.dtype == dtype
    torch.testing.assert_close(got_x.grad.float(), want_x.grad.float(), rtol=1e-5, atol=1e-6)
    if extra:
        assert torch.count_nonzero(got_x.grad[:, n:]) == 0, "positions past the targets are not scored"


def test_the_callers_logits_are_left_as_they_were():
    """A float32 chunk is converted with a copy: the in-place softmax never writes into the
    caller's logits (which the graph still holds)."""
    logits = torch.randn(2, 5, 11, dtype=torch.float32, requires_grad=True)
    before = logits.detach().clone()
    targets = torch.randint(0, 11, (2, 4))
    picked_log_probs(logits, targets, 0.5).sum().backward()
    assert torch.equal(logits.detach(), before)


def test_one_packed_row_and_the_public_entry_point():
    logits = torch.randn(7, 13, requires_grad=True)
    targets = torch.randint(0, 13, (7,))
    got = token_log_probs(logits, targets, (), 2.0)
    assert got.shape == (7,)
    torch.testing.assert_close(got, plain(logits, targets, 2.0))
    with pytest.raises(ValueError, match="8 targets for 7 positions"):
        picked_log_probs(logits, torch.zeros(8, dtype=torch.long))


def test_banned_ids_still_take_the_masked_path_with_a_temperature():
    """A vision model's placeholder ids are removed from the distribution; the temperature
    applies there too, and the trailing position is not scored."""
    logits = torch.randn(2, 6, 9)
    targets = torch.tensor([[1, 2, 3, 4, 5], [8, 8, 0, 1, 2]])
    got = token_log_probs(logits, targets, (8,), 0.5)
    x = (logits[:, :5] / 0.5).index_fill(-1, torch.tensor([8]), float("-inf"))
    want = (x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1)).masked_fill(targets == 8, 0.0)
    torch.testing.assert_close(got, want)
