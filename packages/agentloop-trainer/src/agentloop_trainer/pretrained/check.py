"""Does a converted folder reproduce the model it was converted from?

The folder is reloaded from disk the way training loads it and compared with the in-memory model
on one chat-rendered prompt: same token ids from both tokenizers, same rendered template, same
logits. The weights are copied, not recomputed, so the logits agree exactly; the tolerance only
leaves room for kernels that differ in the last bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOGIT_TOLERANCE = 1e-4
CHECK_MESSAGES = ({"role": "user", "content": "What is 12 + 7?"},)
CHECK_NEW_TOKENS = 8


@dataclass(frozen=True)
class FolderCheck:
    """The result of comparing a saved folder with the model it was saved from."""

    prompt_tokens: int
    """Length of the check prompt in tokens."""
    max_abs_logit_diff: float
    """max |reloaded - in-memory| over every position and vocabulary entry of the prompt."""
    tokenizer_matches: bool
    """Whether the reloaded tokenizer encodes the prompt to the same ids."""
    chat_template_matches: bool
    """Whether the reloaded tokenizer renders the messages to the same text."""
    generated_ids: tuple[int, ...]
    """Greedy continuation of the prompt by the reloaded model."""
    generated_text: str
    """Those ids decoded (special tokens kept, so an early end of turn shows)."""
    seconds: float
    """Wall time of the check."""

    @property
    def ok(self) -> bool:
        """Whether the folder reproduces the model: same ids, same template, logits within tolerance."""
        return self.tokenizer_matches and self.chat_template_matches and self.max_abs_logit_diff <= LOGIT_TOLERANCE


def render_prompt(tokenizer: Any, messages: tuple[dict[str, str], ...] = CHECK_MESSAGES) -> str:
    """The messages through the tokenizer's chat template; plain text when it has none."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def check_folder(folder: str | Path, reference: Any, reference_tokenizer: Any,
                 max_new_tokens: int = CHECK_NEW_TOKENS) -> FolderCheck:
    """Reload ``folder`` and compare it with ``reference`` (see the module docstring).

    Args:
        folder: The saved Hugging Face folder.
        reference: The model it was saved from, in memory.
        reference_tokenizer: The tokenizer it was saved from.
        max_new_tokens: How many tokens the reloaded model generates greedily.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = render_prompt(reference_tokenizer)
    # The template writes any BOS itself; the tokenizer must not add another.
    ids = reference_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reloaded_ids = tokenizer(render_prompt(tokenizer), add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = reference(x).logits
        got = model(x).logits
        pad = model.generation_config.pad_token_id
        # pyright's ignore: transformers types from_pretrained's model as a class its own generate's
        # self-type protocol (GenerativePreTrainedModel) does not admit.
        out = model.generate(  # pyright: ignore[reportAttributeAccessIssue]
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    generated = tuple(int(t) for t in out[0, len(ids):])
    return FolderCheck(
        prompt_tokens=len(ids),
        max_abs_logit_diff=float((got - want).abs().max()),
        tokenizer_matches=reloaded_ids == ids,
        chat_template_matches=render_prompt(tokenizer) == prompt,
        generated_ids=generated,
        generated_text=tokenizer.decode(list(generated)),
        seconds=time.perf_counter() - started,
    )
