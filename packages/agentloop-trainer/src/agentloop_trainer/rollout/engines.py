"""The rollout engine named by ``actor_rollout_ref.rollout.name`` (hf, vllm, sglang), or the
already-running HTTP servers of ``rollout.server_urls``.

Every engine is built through :func:`build_engine` from the same arguments, in the trainer
process or inside a Ray replica (:func:`engine_factory` returns a picklable callable), and is
driven the same way afterwards: ``generate``, then ``sleep`` / ``update_weights`` /
``wake_up`` around each update where the engine declares those capabilities.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentloop_trainer.config.sections import TrainConfig

EXTRAS = {"hf": "hf", "vllm": "vllm", "sglang": "sglang"}


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from (plain values, so it pickles to a Ray replica)."""

    name: str
    """hf | vllm | sglang."""
    model_path: str
    """Checkpoint folder the engine loads."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None: the checkpoint's."""
    device: str = "cpu"
    """Device of the hf engine (vLLM/SGLang pick their own)."""
    seed: int = 0
    """Engine seed."""
    dtype: str | None = "float32"
    """Dtype the engine runs in (float32 | bfloat16 | float16; vllm/sglang also ``auto``, their
    own choice); :func:`engine_spec` sets it from :func:`rollout_dtype`. None: the adapter's
    default (float32 for a float32 checkpoint in all three adapters)."""
    max_model_len: int | None = None
    """Context length."""
    max_batch_size: int = 128
    """hf: requests decoded together."""
    gpu_memory_utilization: float = 0.5
    """vLLM ``gpu_memory_utilization`` / SGLang ``mem_fraction_static``."""
    tensor_model_parallel_size: int = 1
    """GPUs per engine."""
    enforce_eager: bool = True
    """vLLM: no CUDA graphs."""
    free_cache_engine: bool = True
    """SGLang: start with the memory saver so sleep frees memory."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """``rollout.engine_kwargs.<name>``: passed to the engine's constructor last (they win)."""
    chat_template: str | None = None
    """The chat template (Jinja text of ``model.custom_chat_template``) of the tokenizer an engine
    built without one loads (a Ray replica): its own chat completions render as the run does.
    None: the checkpoint's."""


def rollout_dtype(cfg: TrainConfig, notice: Callable[[str], None] | None = None) -> str:
    """The dtype the rollout engine runs in: ``actor_rollout_ref.rollout.dtype``, or float32.

    float32 is what the trainer's log-probs are computed against. With ``model.dtype=float32``
    they match (HFServer's log-probs equal the trainer's to 1e-4). With
    ``model.dtype=bfloat16`` (mixed precision) no engine dtype reproduces the trainer's numbers
    (its autocast and FSDP2 paths differ from each other by 0.034 nats per token), and a
    bfloat16 engine is no closer than a float32 one (SmolLM2-135M, 256 sampled tokens, mean
    gap to the trainer's log-probs, autocast / FSDP2: float32 engine 0.024 / 0.031, bfloat16
    engine 0.035 / 0.031 nats), so float32 is kept there too: the master weights the engine
    receives are float32. ``rollout.dtype=bfloat16`` halves the engine's weight memory at that
    gap. Left to vLLM or SGLang (``auto``), a float32 checkpoint runs in float16 (0.126 nats
    off on a resumed partial rollout, measured on SGLang).

    Args:
        cfg: A training config.
        notice: Receives one line when the engine's dtype differs from ``model.dtype``
            (None: printed to stderr, as config notices are).
    """
    trained, given = cfg.model.dtype, cfg.actor_rollout_ref.rollout.dtype
    dtype = given or "float32"
    if dtype != trained:
        if given is None:
            line = (f"the rollout engine runs in float32 (actor_rollout_ref.rollout.dtype unset): with "
                    f"model.dtype={trained} (mixed precision) a {trained} engine is no closer to the "
                    f"trainer's log-probs; set rollout.dtype={trained} to halve the engine's weight memory")
        else:
            line = (f"actor_rollout_ref.rollout.dtype={given} but the trainer computes log-probs in "
                    f"model.dtype={trained}: rollout and trainer log-probs differ by that precision gap "
                    "(the log-prob check and TIS see it); unset rollout.dtype to run the engine in float32")
        if notice is None:
            print(f"agentloop: {line}", file=sys.stderr)
        else:
            notice(line)
    return dtype


def engine_spec(cfg: TrainConfig, model_path: str, tokenizer_path: str | None = None,
                notice: Callable[[str], None] | None = None) -> EngineSpec:
    """The :class:`EngineSpec` of a training config (``notice``: see :func:`rollout_dtype`)."""
    from agentloop_trainer.config.accessors import custom_chat_template
    from agentloop_trainer.config.nodes import plain_dict

    r = cfg.actor_rollout_ref.rollout
    if r.server_urls:  # remote servers run in their own dtype: nothing to say here
        notice = lambda line: None  # noqa: E731
    per_engine = (plain_dict(r.engine_kwargs, "actor_rollout_ref.rollout.engine_kwargs")
                  if r.engine_kwargs is not None else {})
    unknown = sorted(set(per_engine) - set(EXTRAS))
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs has sections {unknown}; valid: {sorted(EXTRAS)}")
    max_len = r.max_model_len
    if max_len is None and r.name != "hf":
        # vLLM/SGLang reserve KV cache for the whole context: size it to what a trajectory needs.
        max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    return EngineSpec(
        name=r.name, model_path=str(model_path), tokenizer_path=tokenizer_path, device=cfg.trainer.device,
        seed=cfg.trainer.seed, dtype=rollout_dtype(cfg, notice), max_model_len=max_len, max_batch_size=r.max_batch_size,
        gpu_memory_utilization=r.gpu_memory_utilization, tensor_model_parallel_size=r.tensor_model_parallel_size,
        enforce_eager=r.enforce_eager, free_cache_engine=r.free_cache_engine,
        kwargs=dict(per_engine.get(r.name) or {}), chat_template=custom_chat_template(cfg),
    )


ENGINE_ARGS: dict[str, dict[str, str]] = {
    "vllm": {"seed": "seed", "tensor_model_parallel_size": "tensor_parallel_size",
             "gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager",
             "dtype": "dtype", "max_model_len": "max_model_len"},
    "sglang": {"seed": "random_seed", "tensor_model_parallel_size": "tp_size",
               "gpu_memory_utilization": "mem_fraction_static", "free_cache_engine": "enable_memory_saver",
               "dtype": "dtype", "max_model_len": "context_length"},
}
"""The :class:`EngineSpec` fields each engine takes, by the engine's own argument name."""


def engine_arguments(spec: EngineSpec) -> dict[str, Any]:
    """Constructor arguments of a vLLM/SGLang engine: the spec's fields under the engine's names
    (unset ones left to the engine's default), then ``engine_kwargs.<name>``, which win."""
    args = {theirs: getattr(spec, ours) for ours, theirs in ENGINE_ARGS[spec.name].items()
            if getattr(spec, ours) is not None}
    return {**args, **spec.kwargs}


def _missing(name: str, exc: ImportError) -> ImportError:
    # The adapters' own messages name the package and the pip line; keep theirs when present.
    hint = "" if "pip install" in str(exc) else f': pip install "agentloop-engines[{EXTRAS[name]}]"'
    return ImportError(f"actor_rollout_ref.rollout.name={name}: {exc}{hint}")


def build_engine(spec: EngineSpec, model: Any = None, tokenizer: Any = None) -> Any:
    """Start the engine ``spec`` names.

    Args:
        spec: What to build.
        model: hf only: an in-memory copy of the policy to serve instead of loading the path.
        tokenizer: A loaded tokenizer (else loaded from ``spec``, with ``spec.chat_template``).

    Raises:
        ImportError: naming the extra to install when the engine's package is missing.
    """
    tok = tokenizer if tokenizer is not None else (spec.tokenizer_path or spec.model_path)
    if tokenizer is None and spec.chat_template is not None:
        from transformers import AutoTokenizer

        from agentloop_core.tokenization import set_chat_template

        tok = set_chat_template(AutoTokenizer.from_pretrained(str(tok)), spec.chat_template)
    if spec.name == "hf":
        from agentloop_engines.hf import HFServer

        return HFServer(model if model is not None else spec.model_path, tok, device=spec.device, dtype=spec.dtype,
                        max_batch_size=spec.max_batch_size, max_model_len=spec.max_model_len, seed=spec.seed,
                        **spec.kwargs)
    if spec.name not in ENGINE_ARGS:
        raise ValueError(f"unknown engine {spec.name!r}; actor_rollout_ref.rollout.name is one of {sorted(EXTRAS)}")
    try:
        if spec.name == "vllm":
            from agentloop_engines.vllm_server import VLLMServer

            return VLLMServer(model=spec.model_path, tokenizer=tok, **engine_arguments(spec))
        from agentloop_engines.sglang_server import SGLangServer

        if tokenizer is None or isinstance(tok, str):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tok)
        return SGLangServer(model_path=spec.model_path, tokenizer=tok, **engine_arguments(spec))
    except ImportError as exc:
        raise _missing(spec.name, exc) from exc


def engine_factory(spec: EngineSpec) -> Callable[[], Any]:
    """A picklable zero-argument callable that builds the engine (for Ray replicas)."""
    return functools.partial(build_engine, spec)


def remote_engines(urls: list[str], api_key_env: str | None = None) -> Any:
    """A routing client over already-running agentloop engine HTTP servers.

    Raises:
        ValueError: ``api_key_env`` names an unset environment variable.
    """
    from agentloop_engines.client import LLMServerClient
    from agentloop_engines.http_client import RemoteServer

    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"actor_rollout_ref.rollout.server_api_key_env={api_key_env} but that environment "
                             "variable is unset or empty")
    return LLMServerClient([RemoteServer(str(u), api_key=key) for u in urls])


def capabilities(server: Any) -> Mapping[str, Any]:
    """An engine's (or client's) declared capabilities as a dict ({} when it declares none)."""
    caps = getattr(server, "capabilities", None)
    return caps.as_dict() if caps is not None and hasattr(caps, "as_dict") else {}
