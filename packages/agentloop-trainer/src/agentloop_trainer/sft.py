"""SFT warm-up: teach the tiny model the tool-call format from the (biased) teacher.

Conversations are tokenized the way a rollout builds them: the prompt, each assistant turn
and each tool turn are encoded as separate segments of the same chat-template rendering, so the
ids the SFT model learns are the ids it will later see and generate. Loss is on assistant
tokens only (the generated turn through its ``<|im_end|>``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_trainer.config import SFTSection
from agentloop_trainer.task import Problem, demonstration, tool_schemas


@dataclass(frozen=True)
class TokenizedConversation:
    """A conversation as ids with a loss mask."""

    input_ids: list[int]
    """All token ids, prompt included."""
    loss_mask: list[int]
    """1 on assistant-generated tokens (trained), 0 elsewhere."""


def _render(tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None = None,
                          check_prefix: bool = True) -> TokenizedConversation:
    """Tokenize a conversation segment by segment with a mask on assistant turns.

    Args:
        tokenizer: Hugging Face tokenizer with a chat template and an EOS token.
        messages: Chat messages; the last one must be an assistant turn.
        tools: Tool schemas rendered into the system turn.
        check_prefix: Also render each assistant turn as the last message and check the full
            conversation extends it (what a rollout generates is what SFT trains). Costs two
            renders per assistant turn; conversations of one shape need it once.

    Returns:
        Ids and loss mask. Text after the final assistant turn's EOS is dropped, as a rollout
        ends there.

    Raises:
        ValueError: when the template does not render conversations as growing prefixes, or an
            assistant turn does not end with the EOS token.
    """
    eos = tokenizer.eos_token
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    full = _render(tokenizer, messages, tools, False)

    def put(text: str, m: int) -> None:
        if text:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids.extend(piece)
            mask.extend([m] * len(piece))

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, True)
        after = _render(tokenizer, messages[: i + 1], tools, False) if check_prefix else full
        if not (full.startswith(before) and after.startswith(before) and full.startswith(after)):
            raise ValueError(
                f"the chat template does not render message {i} as an extension of the history; "
                "delta tokenization needs a prefix-stable template"
            )
        turn = after[len(before):]
        end = turn.find(eos)
        if end < 0:
            raise ValueError(f"assistant message {i} does not end with the EOS token {eos!r}")
        generated = turn[: end + len(eos)]
        put(full[cursor: len(before)], 0)
        put(generated, 1)
        cursor = len(before) + len(generated)
    if messages[-1]["role"] != "assistant":
        raise ValueError("the last message of an SFT conversation must be an assistant turn")
    return TokenizedConversation(ids, mask)


def demonstration_batch(tokenizer: Any, problems: Sequence[Problem], rng: random.Random,
                        flip_prob: float, biased_templates: tuple[int, ...],
                        check_prefix: bool = True) -> list[TokenizedConversation]:
    """Tokenized teacher demonstrations for ``problems`` (all of one shape: system, user,
    tool call, tool result, answer; ``check_prefix`` applies to the first only)."""
    tools = tool_schemas()
    return [
        tokenize_conversation(tokenizer, demonstration(p, rng, flip_prob, biased_templates), tools,
                              check_prefix=check_prefix and k == 0)
        for k, p in enumerate(problems)
    ]


def sft_loss(model: Any, examples: Sequence[TokenizedConversation]) -> Any:
    """Mean next-token negative log-likelihood over tokens whose loss mask is 1.

    The rows' shared prompt prefix (system turn and tool schemas) is computed once, see
    :func:`agentloop_trainer.forward.sequence_log_probs`.
    """
    import torch

    from agentloop_trainer.forward import sequence_log_probs

    first = min((e.loss_mask.index(1) for e in examples if 1 in e.loss_mask), default=1)
    logp = sequence_log_probs(model, [e.input_ids for e in examples], first_scored=first)
    n = logp.shape[1] + 1
    weight = torch.zeros((len(examples), n), dtype=logp.dtype, device=logp.device)
    for row, e in enumerate(examples):
        weight[row, : len(e.loss_mask)] = torch.as_tensor(e.loss_mask, dtype=logp.dtype)
    weight = weight[:, 1:]
    return -(logp * weight).sum() / weight.sum().clamp(min=1.0)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class SFTConfig(SFTSection):
    """SFT warm-up settings: the config's ``sft`` section (see
    :class:`~agentloop_trainer.config.SFTSection` for its fields) plus the optimizer's weight decay."""

    weight_decay: float = 0.0
    """AdamW weight decay."""


STOP_WINDOW = 50
"""Last steps of a schedule whose mean loss is compared with ``SFTSection.stop_loss``."""


def window_mean(losses: Sequence[float]) -> float:
    """Mean loss of the last :data:`STOP_WINDOW` steps (nan before any step)."""
    tail = losses[-STOP_WINDOW:]
    return sum(tail) / len(tail) if tail else math.nan


def learned(losses: Sequence[float], stop_loss: float | None) -> bool:
    """Whether the mean loss of the last :data:`STOP_WINDOW` steps is below ``stop_loss``
    (None: the warm-up never repeats, so it counts as learned)."""
    return stop_loss is None or (bool(losses) and window_mean(losses) < stop_loss)


def train_sft(model: Any, tokenizer: Any, problems: Sequence[Problem], config: SFTConfig,
              biased_templates: tuple[int, ...], progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``model`` in place on teacher demonstrations of ``problems``.

    Runs the learning-rate schedule (``config.steps`` steps: linear warm-up, cosine decay), and
    runs it again from the start (a warm restart) while the demonstrations are not learned
    (:func:`learned` with ``config.stop_loss``) and another run fits in ``config.max_steps``.

    Returns:
        The loss of every step run.
    """
    import torch

    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    model.train()
    losses: list[float] = []
    budget = max(config.steps, config.max_steps or 0)
    while True:
        for k in range(config.steps):
            step = len(losses)
            for group in opt.param_groups:
                group["lr"] = cosine_lr(k, config.steps, config.lr, config.warmup_steps)
            chosen = [problems[rng.randrange(len(problems))] for _ in range(config.batch_size)]
            # The demonstrations' template rendering is checked on the first step (one shape for all).
            examples = demonstration_batch(tokenizer, chosen, rng, config.flip_prob, biased_templates,
                                           check_prefix=step == 0)
            loss = sft_loss(model, examples)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(step, losses[-1])
        if learned(losses, config.stop_loss) or len(losses) + config.steps > budget:
            break
    model.eval()
    return losses
