"""Engines as plug-ins: the ``agentloop.engines`` entry-point group, or
:func:`register_engine` in code.

An engine package declares one :class:`EnginePlugin` per engine: its name (the value of the
trainer's ``actor_rollout_ref.rollout.name``), a factory named by import path, the pip line that
installs what the factory needs, and what the engine can do (:class:`EngineCapabilities`).
Every engine is built from the same :class:`EngineConfig`; the factory maps that record to its
own constructor, so a caller never needs to know which engine it starts. Example, in the
engine package's ``pyproject.toml``::

    [project.entry-points."agentloop.engines"]
    my_engine = "my_pkg.plugin:MY_ENGINE"

where ``my_pkg/plugin.py`` holds ``MY_ENGINE = EnginePlugin(name="my_engine", ...)``. Keep that
module light (core only): listing the installed engines imports every plug-in record, and a
record that needs the engine's own package to import would hide it from that list; the factory
is imported only when the engine is built.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from agentloop_core.plugins import InvalidPluginError, PluginRegistry, UnknownPluginError
from agentloop_core.protocol import AsyncServer, ServerCapabilities

__all__ = [
    "ENTRY_POINT_GROUP",
    "EngineCapabilities",
    "EngineConfig",
    "EngineFactory",
    "EngineImportError",
    "EnginePlugin",
    "UnknownEngineError",
    "build_engine",
    "engine_factory",
    "engine_names",
    "get_engine_plugin",
    "register_engine",
]

ENTRY_POINT_GROUP = "agentloop.engines"

DEFAULT_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes every engine is expected to run in (``EngineConfig.dtype``)."""


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from: the same record for every engine, of plain values so it
    pickles to a Ray replica. Each engine's factory reads the fields it has a use for."""

    name: str
    """The engine plug-in's name (:attr:`EnginePlugin.name`)."""
    model_path: str
    """Checkpoint folder the engine loads."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None: the checkpoint's."""
    device: str = "cpu"
    """Device of an engine that runs on the one the caller picks (cpu | cuda); engines that
    place themselves (vLLM, SGLang) ignore it."""
    seed: int = 0
    """Engine seed."""
    dtype: str | None = "float32"
    """Dtype the engine runs in: one of the plug-in's :attr:`EngineCapabilities.dtypes`. None:
    the engine's default (float32 for a float32 checkpoint in agentloop-engines' adapters)."""
    max_model_len: int | None = None
    """Context length; None: the engine's own (the model's, or what its KV cache allows)."""
    max_batch_size: int = 128
    """Most requests an engine that batches them itself decodes together (hf)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of accelerator memory an engine that reserves it may take (vLLM
    ``gpu_memory_utilization``, SGLang ``mem_fraction_static``)."""
    tensor_model_parallel_size: int = 1
    """Accelerators one engine spans."""
    enforce_eager: bool = True
    """No CUDA graphs or compilation (vLLM): fast start-up."""
    free_cache_engine: bool = True
    """Start so that ``sleep`` can free accelerator memory (SGLang's memory saver)."""
    enable_prefix_caching: bool = True
    """Reuse the keys and values of a prompt prefix the engine already computed (vLLM's
    ``enable_prefix_caching``; SGLang's radix cache, off with ``disable_radix_cache``; HFServer:
    a trajectory's earlier turns). Exact; False recomputes every prompt."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Engine-specific constructor arguments (the trainer's ``rollout.engine_kwargs.<name>``),
    passed last so they win over the mapped fields."""
    chat_template: str | None = None
    """Jinja text of the chat template the engine's tokenizer renders with, when the engine
    loads its own tokenizer (a Ray replica): its chat completions then render as the run does.
    None: the checkpoint's."""

    def arguments(self, names: Mapping[str, str]) -> dict[str, Any]:
        """Constructor arguments for an engine: the fields ``names`` maps (field -> the engine's
        argument name) that are set (not None), then :attr:`engine_kwargs`, which win.

        Raises:
            ValueError: ``names`` maps something that is not a field of this record.
        """
        unknown = sorted(set(names) - _CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"EngineConfig has no fields {unknown}; valid: {sorted(_CONFIG_FIELDS)}")
        mapped = {theirs: getattr(self, ours) for ours, theirs in names.items() if getattr(self, ours) is not None}
        return {**mapped, **self.engine_kwargs}


_CONFIG_FIELDS = frozenset(f.name for f in fields(EngineConfig))


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared by its plug-in so callers can check a configuration
    before anything starts. An engine instance still reports its own
    :class:`~agentloop_core.protocol.ServerCapabilities` (``server.capabilities``), which may be
    narrower than :attr:`server` where it depends on how it was built (sleep only on CUDA)."""

    server: ServerCapabilities
    """The engine class's declared server capabilities, the same object as its
    ``capabilities`` class attribute (one source): log-probs, sleep/wake_up, weight update,
    prefix cache, chat completions."""
    partial_rollout: bool = False
    """``abort`` returns the tokens generated so far with their log-probs, and a request that
    continues from them resumes the trajectory (the trainer's ``trainer.mode=async`` and
    ``one_step_off`` interrupt and resume rollouts around weight updates)."""
    seeded_sampling: bool = False
    """``SamplingParams.seed`` reproduces a sample (same prompt, seed and weights, same tokens)."""
    policy_copy: bool = False
    """The factory accepts ``model=``: an in-memory copy of the policy to serve instead of
    loading ``model_path`` (the in-process trainer hands one over and pushes weights into it)."""
    reserves_kv_cache: bool = False
    """The engine reserves KV cache for its whole context at start, so an unset
    ``EngineConfig.max_model_len`` should be sized to what one trajectory needs (prompt plus
    response budget) rather than left to the model's full context."""
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    """Values of ``EngineConfig.dtype`` the engine accepts (``auto``: the engine's own choice)."""

    @property
    def logprobs(self) -> bool:
        """``generate`` returns each sampled token's log-prob (from :attr:`server`)."""
        return self.server.logprobs

    @property
    def sleep(self) -> bool:
        """``sleep``/``wake_up`` release and restore accelerator memory (from :attr:`server`)."""
        return self.server.sleep

    @property
    def weight_update(self) -> bool:
        """``update_weights`` loads new weights in place (from :attr:`server`)."""
        return self.server.weight_update

    def as_dict(self) -> dict[str, Any]:
        """Every capability by name, the server's flags included."""
        return {**self.server.as_dict(), "partial_rollout": self.partial_rollout,
                "seeded_sampling": self.seeded_sampling, "policy_copy": self.policy_copy,
                "reserves_kv_cache": self.reserves_kv_cache, "dtypes": list(self.dtypes)}


class EngineFactory(Protocol):
    """The callable an :class:`EnginePlugin` names: maps the generic record to its engine."""

    def __call__(self, config: EngineConfig, *, model: Any = None, tokenizer: Any = None) -> AsyncServer:
        """Start the engine.

        Args:
            config: What to build.
            model: An in-memory model to serve (only passed when the plug-in declares
                ``capabilities.policy_copy``).
            tokenizer: A loaded tokenizer, or a tokenizer folder to load.
        """
        ...


class UnknownEngineError(UnknownPluginError):
    """No engine plug-in is installed under the requested name, or it failed to load."""


class EngineImportError(ImportError):
    """An engine's factory (or a package it needs) is not importable; the message names the
    pip line that installs it."""


@dataclass(frozen=True)
class EnginePlugin:
    """One engine as a plug-in (plain values and import paths: it pickles to a Ray replica)."""

    name: str
    """The engine's name, equal to its entry-point name."""
    factory: str
    """Import path of its :class:`EngineFactory`, ``"pkg.module:callable"`` (``callable`` may
    be dotted, e.g. ``Class.from_engine_config``); imported only when the engine is built."""
    install: str
    """The pip line that installs what the factory needs, shown when its import fails, e.g.
    ``pip install "agentloop-engines[vllm]"``."""
    capabilities: EngineCapabilities
    """What the engine can do."""
    description: str = ""
    """One line for listings."""

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not module or not sep or not attr:
            raise ValueError(f"EnginePlugin {self.name!r}: factory must be 'pkg.module:callable', got {self.factory!r}")

    def load_factory(self) -> EngineFactory:
        """Import the factory.

        Raises:
            EngineImportError: naming :attr:`install` when the import fails.
            ValueError: the module lacks the named attribute.
        """
        module_name, _, attr = self.factory.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise EngineImportError(self._missing(exc)) from exc
        for part in attr.split("."):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise ValueError(f"engine {self.name!r}: factory {self.factory!r} names {part!r}, which "
                                 f"{module_name!r} does not define; fix the plug-in record") from None
        return target

    def build(self, config: EngineConfig, *, model: Any = None, tokenizer: Any = None) -> AsyncServer:
        """Start the engine from ``config`` (see :func:`build_engine`).

        Raises:
            EngineImportError: the factory, or a package it imports, is missing.
        """
        factory = self.load_factory()
        try:
            return factory(config, model=model, tokenizer=tokenizer)
        except EngineImportError:
            raise
        except ImportError as exc:  # the engine's own package, imported on first use
            raise EngineImportError(self._missing(exc)) from exc

    def _missing(self, exc: ImportError) -> str:
        # Adapters' own messages often name the pip line already; do not say it twice.
        hint = "" if "pip install" in str(exc) else f"; install it with: {self.install}"
        return f"engine {self.name!r} ({self.factory}): {type(exc).__name__}: {exc}{hint}"


def _adopt(name: str, plugin: object) -> EnginePlugin:
    if not isinstance(plugin, EnginePlugin):
        raise InvalidPluginError(f"is not an agentloop_core.engine_registry.EnginePlugin (got {type(plugin).__name__}); "
                                 "point it at the plug-in record")
    if plugin.name != name:
        raise InvalidPluginError(f"holds the plug-in named {plugin.name!r}; the entry-point name and "
                                 "EnginePlugin.name must agree")
    return plugin


def _how_to_add(name: str) -> str:
    del name
    return ('agentloop\'s own are in agentloop-engines (pip install "agentloop-engines[hf]"); a package adds one '
            f"with an entry point in the {ENTRY_POINT_GROUP!r} group naming an EnginePlugin (see the "
            "conformance suite's README), or in code with agentloop_core.engine_registry.register_engine")


_ENGINES: PluginRegistry[EnginePlugin] = PluginRegistry(
    "engine", ENTRY_POINT_GROUP, error=UnknownEngineError, adopt=_adopt, how_to_add=_how_to_add,
    describe=lambda plugin: f"the plug-in with factory {plugin.factory}", same=lambda a, b: a == b,
    known_label="installed engines", capabilities=lambda plugin: plugin.capabilities)
# The registry's tables, by their old names (tests save and restore them around a fake install).
_REGISTRY = _ENGINES.entries
_BROKEN = _ENGINES.broken


def register_engine(plugin: EnginePlugin) -> EnginePlugin:
    """Register ``plugin`` in code (an entry point is the way for installed packages).

    Raises:
        ValueError: another plug-in already holds the name.
    """
    return _ENGINES.add(plugin.name, plugin)


def engine_names(*, include_broken: bool = False) -> list[str]:
    """The names of the installed engine plug-ins (entry points and :func:`register_engine`).

    Args:
        include_broken: Also the entry points that failed to load.
    """
    return _ENGINES.names(include_broken=include_broken)


def get_engine_plugin(name: str) -> EnginePlugin:
    """Look up an engine plug-in by name.

    Raises:
        UnknownEngineError: listing the installed engines and how to add one, or saying why the
            plug-in under ``name`` failed to load.
    """
    return _ENGINES.get(name)


def build_engine(config: EngineConfig, *, model: Any = None, tokenizer: Any = None,
                 plugin: EnginePlugin | None = None) -> AsyncServer:
    """Start the engine ``config.name`` names.

    Args:
        config: What to build.
        model: An in-memory copy of the policy to serve; ignored unless the plug-in declares
            ``capabilities.policy_copy`` (the others load ``config.model_path``).
        tokenizer: A loaded tokenizer; None: loaded from ``config.tokenizer_path`` (or the
            checkpoint) with ``config.chat_template`` when that is set, else the folder is
            passed on for the engine to load.
        plugin: The plug-in to use (a Ray replica receives it pickled); None: looked up by name.

    Raises:
        UnknownEngineError: no plug-in has that name.
        EngineImportError: naming the pip line when the engine's package is missing.
    """
    plugin = plugin if plugin is not None else get_engine_plugin(config.name)
    tok: Any = tokenizer if tokenizer is not None else (config.tokenizer_path or config.model_path)
    if tokenizer is None and config.chat_template is not None:
        from transformers import AutoTokenizer

        from agentloop_core.tokenization import set_chat_template

        tok = set_chat_template(AutoTokenizer.from_pretrained(str(tok)), config.chat_template)
    return plugin.build(config, model=model if plugin.capabilities.policy_copy else None, tokenizer=tok)


def engine_factory(config: EngineConfig) -> Callable[[], AsyncServer]:
    """A picklable zero-argument callable that builds the engine (for Ray replicas). The
    plug-in record travels with it, so the replica imports only the factory."""
    return functools.partial(build_engine, config, plugin=get_engine_plugin(config.name))
