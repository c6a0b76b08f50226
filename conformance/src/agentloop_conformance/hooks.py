"""Optional hooks an engine author provides so the suite can check more.

Fixtures in :class:`~agentloop_conformance.EngineConformanceTests` (or an :class:`EngineTarget`
returned by a no-code factory) supply them:

* ``reference_log_probs(prompt_ids, token_ids, temperature) -> list[float]``: what a trainer
  computes for the generated tokens with one plain forward pass (log-softmax of logits / T,
  T = 1 for greedy; a vision model's placeholder ids, banned from sampling, removed from it).
  Enables the log-prob accuracy check.
* ``named_weights() -> Mapping[str, tensor]``: the engine's current weights by the names
  ``update_weights`` accepts. Enables the weight-update round trip.
* ``vision_prompt(images, text) -> (prompt_ids, multi_modal_data)``: prompts with images rendered
  with the model's own processor, for an engine that declares ``capabilities.vision``. Built by
  default from the engine's tokenizer and checkpoint folder (see
  :mod:`agentloop_conformance.vision_prompts`); enables the vision checks.
* ``placeholder_engine``: an engine like the one under test serving a checkpoint whose top
  choices are the image placeholders
  (:func:`agentloop_conformance.placeholder_model.placeholder_preferring_checkpoint`). Enables
  the check that placeholders are never generated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_conformance.placeholder_model import placeholder_ids
from agentloop_conformance.vision_prompts import VisionPrompt

ReferenceLogProbs = Callable[[Sequence[int], Sequence[int], float], Sequence[float]]
"""(prompt_ids, token_ids, temperature) -> one reference log-prob per token in token_ids."""
NamedWeights = Callable[[], Mapping[str, Any]]
"""() -> the engine's current weights, name -> tensor."""


@dataclass
class EngineTarget:
    """What a no-code engine factory may return instead of a bare engine."""

    engine: Any
    """The ``AsyncServer`` under test."""
    reference_log_probs: ReferenceLogProbs | None = None
    """Reference log-probs hook (see the module docstring); None skips the accuracy check."""
    named_weights: NamedWeights | None = None
    """Current-weights hook; None skips the weight-update round trip."""
    vision_prompt: VisionPrompt | None = None
    """Prompts-with-images hook; None: the suite builds one from the engine's tokenizer and
    checkpoint folder where it can (else the vision checks skip)."""
    placeholder_engine: Any = None
    """An engine serving a placeholder-preferring checkpoint (see the module docstring), closed
    with ``engine``; None skips the placeholder-ban check."""


def hf_reference_log_probs(model: Any) -> ReferenceLogProbs:
    """A ``reference_log_probs`` hook for a ``transformers`` causal LM (one forward pass, fp32);
    for a vision-language model (a config with ``vision_config``) over the tokens it may sample,
    its image/video placeholder logits at -inf, the convention every engine reports.

    Args:
        model: A ``torch.nn.Module`` whose forward takes ``input_ids`` and returns ``.logits``.

    Returns:
        The hook.
    """
    config = getattr(model, "config", None)
    banned = [t for t in placeholder_ids(config) if t is not None] if getattr(config, "vision_config", None) else []

    def reference(prompt_ids: Sequence[int], token_ids: Sequence[int], temperature: float) -> list[float]:
        import torch

        if not token_ids:
            return []
        device = next(model.parameters()).device
        ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        scaled = logits[len(prompt_ids) - 1 : -1] / (temperature if temperature > 0 else 1.0)
        cols = [t for t in banned if t < scaled.shape[-1]]
        if cols:
            scaled[:, cols] = float("-inf")
        lp = torch.log_softmax(scaled, dim=-1)
        index = torch.tensor(list(token_ids), device=device)[:, None]
        return lp.gather(1, index)[:, 0].tolist()

    return reference


def hf_named_weights(model: Any) -> NamedWeights:
    """A ``named_weights`` hook for a ``torch.nn.Module`` (its ``state_dict``, detached)."""

    def named() -> dict[str, Any]:
        return {name: t.detach() for name, t in model.state_dict().items()}

    return named


def copy_tensor(t: Any) -> Any:
    """An independent copy of a torch tensor or numpy array (``update_weights`` may write into
    the very tensors a hook returned)."""
    if hasattr(t, "detach") and hasattr(t, "clone"):
        return t.detach().clone()
    if hasattr(t, "copy"):
        return t.copy()
    raise TypeError(f"cannot copy a {type(t).__name__}; named_weights must return torch tensors or numpy arrays")


def perturb_tensor(t: Any, seed: int, scale: float = 0.5) -> Any:
    """``t`` plus seeded Gaussian noise of ``scale`` times its std (floating tensors only)."""
    module = type(t).__module__
    if module.startswith("torch"):
        import torch

        if not t.is_floating_point():
            return t
        g = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        std = float(t.float().std()) if t.numel() > 1 else 1.0
        return (t.float().cpu() + noise * scale * (std or 1.0)).to(dtype=t.dtype, device=t.device)
    import numpy as np

    arr = np.asarray(t)
    if not np.issubdtype(arr.dtype, np.floating):
        return t
    rng = np.random.default_rng(seed)
    std = float(arr.std()) if arr.size > 1 else 1.0
    return (arr + rng.standard_normal(arr.shape) * scale * (std or 1.0)).astype(arr.dtype)
