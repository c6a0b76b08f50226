"""The request checks every engine runs before generating, in one place.

``AsyncServerBase`` (the real engines' front half) and the scripted test engine both call
:func:`validate_request`, so a loop test that passes against the scripted engine sends only
requests a real engine would accept, with the same error type and message when it does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.protocol import SamplingParams


def validate_request(
    prompt_ids: Sequence[int],
    sampling_params: Mapping[str, Any] | SamplingParams | None,
    *,
    vocab_size: int,
    max_model_len: int,
) -> SamplingParams:
    """Check a request and return its sampling parameters with ``max_tokens`` clamped.

    Args:
        prompt_ids: The prompt token ids.
        sampling_params: A mapping or :class:`SamplingParams`; unknown keys are errors.
        vocab_size: Number of valid token ids; ids must lie in ``[0, vocab_size)``.
        max_model_len: Context length in tokens (prompt + generated).

    Returns:
        Validated parameters whose ``max_tokens`` fits in ``max_model_len - len(prompt_ids)``.

    Raises:
        ValueError: empty prompt, a non-integer or out-of-vocabulary id (the first bad one and
            its position are named), a prompt that fills the context, or bad sampling params.
    """
    if prompt_ids is None or len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; an engine needs at least one prompt token")
    # The usual list of plain ints is checked in three C passes (per-id Python was ~10% of a
    # zero-latency tool loop's time, bench/bench_loop_overhead.py); anything else, or a bad id,
    # takes the per-id loop, which accepts numpy/torch ints and names the first bad id.
    plain = type(prompt_ids) is list and set(map(type, prompt_ids)) == {int}
    if not (plain and min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size):
        _check_ids(prompt_ids, vocab_size)
    n = len(prompt_ids)
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens but the context is {max_model_len}; shorten it or raise max_model_len"
        )
    sp = SamplingParams.from_mapping(sampling_params)
    for tid in sp.stop_token_ids:
        if not 0 <= tid < vocab_size:
            raise ValueError(f"stop_token_ids contains {tid}, outside the vocabulary [0, {vocab_size})")
    room = max_model_len - n
    if sp.max_tokens > room:
        sp = sp.replace(max_tokens=room)
    return sp


def _check_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """Raise for the first id of ``prompt_ids`` that is not an integer in ``[0, vocab_size)``."""
    for pos, tid in enumerate(prompt_ids):
        # bool is an int subclass but never a token id; numpy/torch ints are fine via __index__.
        if isinstance(tid, bool) or not hasattr(tid, "__index__"):
            raise ValueError(
                f"prompt_ids[{pos}] = {tid!r} is not an integer token id; pass token ids, not "
                "text (tokenize with the model's tokenizer first)"
            )
        if not 0 <= int(tid) < vocab_size:
            raise ValueError(
                f"prompt_ids[{pos}] = {int(tid)} is outside the vocabulary [0, {vocab_size}); "
                "was the prompt tokenized with a different tokenizer than this model's?"
            )
