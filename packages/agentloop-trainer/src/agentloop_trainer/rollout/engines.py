"""The rollout engine: the plug-in ``actor_rollout_ref.rollout.name`` names (an
``agentloop.engines`` entry point, see :mod:`agentloop_core.engine_registry`), or the
already-running HTTP servers of ``rollout.server_urls``.

Every engine is built through :func:`build_engine` from one
:class:`~agentloop_core.engine_registry.EngineConfig`, in the trainer process or inside a Ray
replica (:func:`engine_factory` returns a picklable callable), and is driven the same way
afterwards: ``generate``, then ``sleep`` / ``update_weights`` / ``wake_up`` around each update
where the engine declares those capabilities. What differs between engines is asked of the
plug-in's declared capabilities, never of its name.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from agentloop_core.engine_registry import EngineConfig, EngineImportError, EnginePlugin
from agentloop_core.engine_registry import build_engine as _build
from agentloop_trainer.config_base import plain_dict
from agentloop_trainer.rollout.settings import AS_MODEL, RolloutSection, engine_plugin


def rollout_dtype(rollout: RolloutSection, model_dtype: str, notice: Callable[[str], None] | None = None) -> str:
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
    off on a resumed partial rollout, measured on SGLang). ``rollout.dtype=model`` runs the
    engine in ``model.dtype`` (already resolved for the device): bfloat16 where mixed precision
    trains in it, for the engine's speed and memory, not its closeness.

    Args:
        rollout: The ``actor_rollout_ref.rollout`` section.
        model_dtype: ``model.dtype``, the trainer's.
        notice: Receives one line when the engine's dtype differs from ``model.dtype``
            (None: printed to stderr, as config notices are).
    """
    trained, given = model_dtype, rollout.dtype
    if given == AS_MODEL:
        return trained
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


def engine_config(rollout: RolloutSection, model_path: str, tokenizer_path: str | None = None,
                  notice: Callable[[str], None] | None = None, *, device: str, seed: int, model_dtype: str,
                  context_length: int, chat_template: str | None) -> EngineConfig:
    """The :class:`~agentloop_core.engine_registry.EngineConfig` of the rollout section.

    Args:
        rollout: The ``actor_rollout_ref.rollout`` section.
        model_path: The checkpoint the engine loads.
        tokenizer_path: Its tokenizer folder (None: the checkpoint's).
        notice: See :func:`rollout_dtype`.
        device: ``trainer.device``.
        seed: ``trainer.seed``.
        model_dtype: ``model.dtype`` (see :func:`rollout_dtype`).
        context_length: A trajectory's most tokens (``data.max_prompt_length`` +
            ``data.max_response_length``): the context of an engine that reserves KV cache for it.
        chat_template: The run's chat template text (None: the tokenizer's own).

    Raises:
        ConfigError: ``rollout.name`` is no installed engine.
        ValueError: ``rollout.engine_kwargs`` has a section that is no installed engine's name.
    """
    from agentloop_core.engine_registry import engine_names

    r = rollout
    if r.server_urls:  # remote servers run in their own dtype: nothing to say here
        notice = lambda line: None  # noqa: E731
    per_engine = (plain_dict(r.engine_kwargs, "actor_rollout_ref.rollout.engine_kwargs")
                  if r.engine_kwargs is not None else {})
    installed = engine_names(include_broken=True)
    unknown = sorted(set(per_engine) - set(installed))
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs has sections {unknown}; valid: {installed} "
                         "(the installed engines)")
    max_len = r.max_model_len
    if max_len is None and engine_plugin(r).capabilities.reserves_kv_cache:
        # Such an engine reserves KV cache for the whole context: size it to what a trajectory needs.
        max_len = context_length
    return EngineConfig(
        name=r.name, model_path=str(model_path), tokenizer_path=tokenizer_path, device=device,
        seed=seed, dtype=rollout_dtype(r, model_dtype, notice), max_model_len=max_len, max_batch_size=r.max_batch_size,
        gpu_memory_utilization=r.gpu_memory_utilization, tensor_model_parallel_size=r.tensor_model_parallel_size,
        enforce_eager=r.enforce_eager, free_cache_engine=r.free_cache_engine,
        enable_prefix_caching=r.enable_prefix_caching,
        engine_kwargs=dict(per_engine.get(r.name) or {}), chat_template=chat_template,
    )


def build_engine(config: EngineConfig, model: Any = None, tokenizer: Any = None,
                 plugin: EnginePlugin | None = None) -> Any:
    """Start the engine ``config`` names (see :func:`agentloop_core.engine_registry.build_engine`).

    Args:
        config: What to build.
        model: An in-memory copy of the policy, served by an engine whose plug-in declares
            ``capabilities.policy_copy`` instead of loading the path (others ignore it).
        tokenizer: A loaded tokenizer (else loaded from ``config``, with ``config.chat_template``).
        plugin: The engine's plug-in (None: looked up by ``config.name``).

    Raises:
        ImportError: naming the config key and the pip line when the engine's package is missing.
    """
    try:
        return _build(config, model=model, tokenizer=tokenizer, plugin=plugin)
    except EngineImportError as exc:
        raise EngineImportError(f"actor_rollout_ref.rollout.name={config.name}: {exc}") from exc


def engine_factory(config: EngineConfig) -> Callable[[], Any]:
    """A picklable zero-argument callable that builds the engine (for Ray replicas); the
    plug-in record travels with it."""
    from agentloop_core.engine_registry import get_engine_plugin

    return functools.partial(build_engine, config, plugin=get_engine_plugin(config.name))


def remote_engines(rollout: RolloutSection) -> Any:
    """A routing client over the already-running agentloop engine HTTP servers the rollout
    section names (``server_urls``), with its chat key and control key read from the
    environment variables ``server_api_key_env`` and ``server_control_key_env`` name (the
    control key is what weight pushes, sleep, wake-up and abort need) and each answer read
    within ``server_max_response_bytes``.

    Raises:
        ValueError: an ``*_env`` names an unset environment variable, or no server is named.
    """
    from agentloop_engines.fleet.client import LLMServerClient
    from agentloop_engines.fleet.http_client import EngineHTTPClient

    if not rollout.server_urls:
        raise ValueError("actor_rollout_ref.rollout.server_urls is empty; name the agentloop engine servers to use")
    key = _key_from_env(rollout.server_api_key_env, "server_api_key_env")
    control_key = _key_from_env(rollout.server_control_key_env, "server_control_key_env")
    return LLMServerClient([EngineHTTPClient(str(u), api_key=key, control_key=control_key,
                                         max_response_bytes=rollout.server_max_response_bytes)
                            for u in rollout.server_urls])


def _key_from_env(variable: str | None, setting: str) -> str | None:
    if not variable:
        return None
    key = os.environ.get(variable)
    if not key:
        # The variable's name only: its value is a secret.
        raise ValueError(f"actor_rollout_ref.rollout.{setting}={variable} but that environment variable is unset or "
                         "empty")
    return key


def capabilities(server: Any) -> Mapping[str, Any]:
    """An engine's (or client's) declared capabilities as a dict ({} when it declares none)."""
    caps = getattr(server, "capabilities", None)
    return caps.as_dict() if caps is not None and hasattr(caps, "as_dict") else {}
