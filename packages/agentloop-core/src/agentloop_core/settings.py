"""The rollout's settings as one frozen record: :class:`RolloutConfig`.

The trainer builds it once from its config; :class:`~agentloop_core.runtime.AgentLoopManager`,
:class:`~agentloop_core.runtime.AgentLoopWorker`, the Ray pool (which pickles the record, not a
dict) and every loop take it. A script of its own may hand the manager or the worker a plain
mapping: it is converted with :meth:`RolloutConfig.from_mapping` at the constructor, the one
place a rollout dict is read.

Each loop gets its config built once: the loop's own typed ``config_class`` instance (a frozen
dataclass with a ``from_mapping`` classmethod, see :class:`~agentloop_core.loop.AgentLoopBase`),
or, for a loop that declares none, a dict of :meth:`RolloutConfig.loop_mapping`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from agentloop_core.loop import build_loop_config, require_dataclass
from agentloop_core.protocol import SamplingParams
from agentloop_core.registry import get_agent_loop_class, import_loop_modules, register_loop_classes

__all__ = ["DEFAULT_TURNS_PER_LOOP_ITERATION", "SANITY_CHECK_MODES", "RolloutConfig", "check_loop_config_keys", "loop_config_keys"]

SANITY_CHECK_MODES = ("strict", "ignore_strippable", "disable")
"""The values of :attr:`RolloutConfig.sanity_check`."""

DEFAULT_TURNS_PER_LOOP_ITERATION = 4
"""Turns let through per event-loop iteration. A turn of the tool agent loop costs ~1-2 ms of
CPU (render, tokenize, parse, and the tool's continuation in the next iteration); with 4 the
event loop's p50/p99 lag stayed near 10/30 ms at 4096 samples in flight on one saturated core,
with 8 near 20/60 ms, unpaced 4-5 s (``bench/bench_scale.py``); throughput did not drop."""

LOOP_FIELDS = ("prompt_length", "response_length", "sanity_check")
"""Fields of the record every loop's config also reads (see :meth:`RolloutConfig.loop_mapping`)."""


def _pairs(value: Any, what: str) -> tuple[tuple[str, Any], ...]:
    """``value`` (a mapping, or already ``(key, value)`` pairs) as a tuple of pairs."""
    if isinstance(value, Mapping):
        return tuple((str(k), v) for k, v in value.items())
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return value
    raise ValueError(f"{what} must be a mapping of names to values, got {type(value).__name__}")


def _positive_or_none(name: str, value: Any, *, number: bool, what: str) -> None:
    if value is None:
        return
    ok = (isinstance(value, (int, float)) and value > 0) if number else (isinstance(value, int) and value >= 1)
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{name} must be {what} or None, got {value!r}")


@dataclass(frozen=True)
class RolloutConfig:
    """Everything a rollout runs with, from the trainer (or a script) to the loops.

    Values are checked when the record is built.

    Raises:
        ValueError: naming the field, the bad value and what it accepts.
    """

    default_agent_loop: str | None = None
    """Loop of rows without an ``agent_name`` (trainer: ``rollout.agent.default_agent_loop``)."""
    agent_loop_modules: tuple[str, ...] = ()
    """Modules imported (in every worker process) so their ``@register`` loops exist."""
    agent_loop_classes: tuple[tuple[str, str], ...] = ()
    """``(name, "pkg.module:Class")`` pairs: loops registered by import path."""
    agent_loop_configs: tuple[tuple[str, Any], ...] = ()
    """``(name, config)`` pairs, built once by :meth:`with_loop_configs`: the loop's
    ``config_class`` instance, or for a loop without one its section as ``(key, value)`` pairs
    (merged over :meth:`loop_mapping` when the loop is built). Loops without an entry get their
    config built from :meth:`loop_mapping` by the worker."""
    loop_options: tuple[tuple[str, Any], ...] = ()
    """``(key, value)`` pairs every loop's config is read from besides the record's own loop
    fields: the tool loops' keys (``tool_parser``, ``max_assistant_turns``, the tool paths...)
    and, from a mapping, every key the record does not name. Values are the user's."""
    prompt_length: int | None = None
    """Longest rendered prompt in tokens, and the padded prompt width (trainer:
    ``data.max_prompt_length``); None: no limit, pad to the longest."""
    response_length: int | None = None
    """Token budget of a trajectory's response (generated, tool and user tokens) and the
    padded response width (trainer: ``data.max_response_length``). None sets nothing: each
    loop keeps its own config's default (``DEFAULT_RESPONSE_LENGTH``, the one default, which
    is also a call's ``max_tokens`` when none is given), and the batch pads to the longest."""
    pad_token_id: int | None = None
    """Padding id of the batch; None: the tokenizer's."""
    truncate: bool = False
    """Cut outputs longer than the padded widths instead of raising ``SequenceTooLongError``."""
    sanity_check: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """Delta-tokenization check of every loop (``Trajectory.to_output``; trainer:
    ``rollout.sanity_check``)."""
    custom_chat_template: str | None = None
    """A built-in template name, a Jinja file's path or the template text, set on the tokenizer
    a worker loads from a path (``resolve_chat_template``), so a worker on another process or
    node renders as the driver's tokenizer does."""
    sample_timeout_s: float | None = None
    """A sample running longer fails with ``SampleTimeoutError``; None: no limit."""
    max_concurrent_samples: int | None = None
    """Cap on samples in flight per worker; None: all at once."""
    turns_per_loop_iteration: int | None = DEFAULT_TURNS_PER_LOOP_ITERATION
    """At most this many samples start, and this many turns go on after their ``generate``
    returned (or after a wait a loop ends with ``turn_slot()``: the tool loop's tool calls and
    interaction turns, a LangGraph agent's model calls), per event-loop iteration
    (``agentloop_core.runtime.pacing``); None: no pacing."""
    hold_full_gc: bool = True
    """While a batch is in flight, freeze the objects that existed before it and hold off
    Python's full garbage collections (young ones still run), so none pauses every loop of the
    process; released when the last batch returns (``agentloop_core.runtime.gc_hold``)."""
    switch_interval_s: float | None = 0.002
    """While a batch is in flight, the interpreter's thread switch interval is at most this
    (``sys.setswitchinterval``; Python's default is 0.005), so threads of the process (a sync
    tool's pool) get the GIL from a busy event loop sooner: their calls return sooner and less
    at once;
    restored when the last batch returns (``agentloop_core.runtime.switch_interval``); None:
    left as it is."""
    sampling_seed: int | None = None
    """Every ``generate`` call without its own ``seed`` gets one derived from this, the sample's
    key and the call index (``agentloop_core.runtime.seeding``; trainer: ``trainer.seed``);
    None: the engine's own randomness."""
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling of training rollouts; ``max_tokens`` is the per-turn cap (trainer:
    ``rollout.temperature/top_k/top_p`` and ``multi_turn.max_tokens_per_turn``)."""
    val_sampling_params: SamplingParams | None = None
    """Sampling of ``validate=True`` rollouts (trainer: ``rollout.val_kwargs``); None: as
    training."""
    reward_fn: Any = None
    """Async callable ``reward_fn(output, row, tokenizer) -> None`` that sets
    ``output.reward_score`` (and metrics) as soon as a sample finishes; called once per
    trajectory (on ``trajectory_view`` for several segments); must pickle for Ray; None: the
    loop's own reward. Opaque: the record does not look inside it."""

    def __post_init__(self) -> None:
        if self.default_agent_loop is not None and not isinstance(self.default_agent_loop, str):
            raise ValueError(f"default_agent_loop must be a loop name or None, got {self.default_agent_loop!r}")
        object.__setattr__(self, "agent_loop_modules", _strings(self.agent_loop_modules, "agent_loop_modules"))
        for name in ("agent_loop_classes", "agent_loop_configs", "loop_options"):
            object.__setattr__(self, name, _pairs(getattr(self, name), name))
        _positive_or_none("prompt_length", self.prompt_length, number=False, what="a positive integer")
        _positive_or_none("response_length", self.response_length, number=False, what="a positive integer")
        _positive_or_none("sample_timeout_s", self.sample_timeout_s, number=True,
                          what="a positive number of seconds")
        _positive_or_none("max_concurrent_samples", self.max_concurrent_samples, number=False,
                          what="a positive integer")
        _positive_or_none("turns_per_loop_iteration", self.turns_per_loop_iteration, number=False,
                          what="a positive integer")
        _positive_or_none("switch_interval_s", self.switch_interval_s, number=True,
                          what="a positive number of seconds")
        seed = self.sampling_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"sampling_seed must be an integer or None, got {seed!r}")
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
            raise ValueError(f"pad_token_id must be a token id (an integer >= 0) or None, got {pad!r}")
        if not isinstance(self.hold_full_gc, bool):
            raise ValueError(f"hold_full_gc must be true or false, got {self.hold_full_gc!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be true or false, got {self.truncate!r}")
        if self.sanity_check not in SANITY_CHECK_MODES:
            raise ValueError(f"sanity_check must be one of {SANITY_CHECK_MODES}, got {self.sanity_check!r}")
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams; build the record with "
                             "RolloutConfig.from_mapping to pass a mapping")
        if self.val_sampling_params is not None and not isinstance(self.val_sampling_params, SamplingParams):
            raise ValueError("val_sampling_params must be a SamplingParams or None; build the record with "
                             "RolloutConfig.from_mapping to pass a mapping")
        if self.reward_fn is not None and not callable(self.reward_fn):
            raise ValueError(f"reward_fn must be an async callable (output, row, tokenizer), got "
                             f"{type(self.reward_fn).__name__}")

    @classmethod
    def of(cls, config: RolloutConfig | Mapping[str, Any] | None) -> RolloutConfig:
        """``config`` itself, or a script's mapping converted once with :meth:`from_mapping` (what
        the manager's and the worker's constructors accept)."""
        return config if isinstance(config, RolloutConfig) else cls.from_mapping(config)

    def register_loops(self) -> None:
        """Import :attr:`agent_loop_modules` and register :attr:`agent_loop_classes`, so every
        loop this config names resolves by name in this process."""
        import_loop_modules(self.agent_loop_modules)
        register_loop_classes(dict(self.agent_loop_classes))

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None) -> RolloutConfig:
        """The record of a rollout dict (the keys are the field names; an OmegaConf node is
        fine). ``sampling_params`` and ``val_sampling_params`` are mappings, the latter merged
        over the former; ``agent_loop_configs`` maps loop names to their sections, built into
        the loops' configs here (:meth:`with_loop_configs`); every other key is a loop option.

        A ``sampling_params`` without ``max_tokens`` gets ``response_length`` (when set): a turn
        may then use what is left of the budget, as a loop given no per-turn cap does.

        Raises:
            ValueError: a bad value, naming the key; a section key its loop does not read.
            ImportError: an ``agent_loop_modules`` module that does not import.
        """
        data = _plain(config or {})
        if not isinstance(data, Mapping):
            raise ValueError(f"a rollout config must be a mapping of settings, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        options = {k: v for k, v in data.items() if k not in names}
        sections = known.pop("agent_loop_configs", None) or {}
        if not isinstance(sections, Mapping) or not all(isinstance(v, Mapping) for v in sections.values()):
            raise ValueError(f"agent_loop_configs must map loop names to dicts of settings, got {sections!r}")
        train = dict(known.pop("sampling_params", None) or {})
        if "max_tokens" not in train and known.get("response_length") is not None:
            train["max_tokens"] = known["response_length"]
        val = known.pop("val_sampling_params", None)
        known["sampling_params"] = _sampling(train, "sampling_params")
        if val:
            known["val_sampling_params"] = _sampling({**train, **val}, "sampling_params / val_sampling_params")
        for key in ("agent_loop_modules",):
            if key in known:
                known[key] = tuple(known[key] or ())
        if "agent_loop_classes" in known:
            known["agent_loop_classes"] = _pairs(known["agent_loop_classes"] or {}, "agent_loop_classes")
        if "sanity_check" in known and known["sanity_check"] is None:
            del known["sanity_check"]
        if "truncate" in known:
            known["truncate"] = bool(known["truncate"])
        record = cls(**known, loop_options=tuple(options.items()))
        return record.with_loop_configs(sections) if sections else record

    def loop_mapping(self, section: Iterable[tuple[str, Any]] = ()) -> dict[str, Any]:
        """What a loop's config is read from: the record's loop fields (:data:`LOOP_FIELDS`),
        :attr:`loop_options`, then the loop's own ``section`` pairs over them."""
        return {**{k: getattr(self, k) for k in LOOP_FIELDS}, **dict(self.loop_options), **dict(section)}

    def with_loop_configs(self, sections: Mapping[str, Mapping[str, Any]],
                          also: Iterable[str] = ()) -> RolloutConfig:
        """A copy whose :attr:`agent_loop_configs` holds each named loop's config built once:
        ``config_class.from_mapping(loop_mapping(section))`` for a loop with a config class
        (a section key it does not read is an error), the section's pairs for one without.

        Args:
            sections: Per-loop settings by loop name.
            also: Loops to build a config for without a section (the default loop).

        Raises:
            ValueError: naming the loop and the unknown key (with the closest valid one), or
                a bad value as the loop's config class reports it.
            UnknownAgentLoopError: a section for a loop that is not registered.
        """
        self.register_loops()
        built = dict(self.agent_loop_configs)
        for name in dict.fromkeys([*sections, *also]):
            section = dict(sections.get(name) or {})
            config_class = getattr(get_agent_loop_class(name), "config_class", None)
            if config_class is None:
                if section:
                    built[name] = tuple(section.items())
                continue
            check_loop_config_keys(name, config_class, section)
            built[name] = build_loop_config(config_class, self.loop_mapping(section.items()))
        return dataclasses.replace(self, agent_loop_configs=tuple(built.items()))

    def loop_config(self, name: str, loop_class: type) -> Any:
        """The config loop ``name`` (class ``loop_class``) is constructed with: its entry in
        :attr:`agent_loop_configs` (a section's pairs become a dict over :meth:`loop_mapping`),
        else its ``config_class`` built from :meth:`loop_mapping`, else that mapping itself."""
        entry = dict(self.agent_loop_configs).get(name)
        config_class = getattr(loop_class, "config_class", None)
        if entry is not None and not (isinstance(entry, tuple) and config_class is not None):
            return self.loop_mapping(entry) if isinstance(entry, tuple) else entry
        mapping = self.loop_mapping(entry or ())
        return mapping if config_class is None else build_loop_config(config_class, mapping)

    def sampling_for(self, validate: bool) -> SamplingParams:
        """The sampling of a batch: :attr:`val_sampling_params` when ``validate`` and set."""
        return self.val_sampling_params if validate and self.val_sampling_params is not None else self.sampling_params


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of module names, got {value!r}")
    return tuple(value)


def _sampling(params: Mapping[str, Any], key: str) -> SamplingParams:
    try:
        return SamplingParams.from_mapping(params)
    except ValueError as exc:
        raise ValueError(f"config {key}: {exc}") from exc


def _plain(value: Any) -> Any:
    """Mappings (an OmegaConf ``DictConfig`` included) as dicts, other values as they are."""
    if hasattr(value, "_metadata") and hasattr(value, "_get_node"):  # OmegaConf container
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def loop_config_keys(config_class: type) -> frozenset[str]:
    """Every key a loop with this config class reads: the dataclass fields plus its
    ``EXTRA_KEYS`` (empty when the class declares none).

    Raises:
        TypeError: ``config_class`` is not a dataclass.
    """
    require_dataclass(config_class)
    extra = getattr(config_class, "EXTRA_KEYS", ())
    return frozenset(f.name for f in dataclasses.fields(config_class)) | frozenset(extra)


def check_loop_config_keys(loop_name: str, config_class: type, keys: Iterable[str]) -> None:
    """Reject keys of a loop's config section that the loop would ignore, so a typo such as
    ``max_assistant_turn`` is an error instead of a silently unused setting.

    Args:
        loop_name: The loop's registered name, for the message (``"tool_agent"``).
        config_class: The loop's ``config_class`` (a dataclass, optionally with ``EXTRA_KEYS``).
        keys: The keys of the user's section for this loop.

    Raises:
        ValueError: naming each unknown key with the closest valid key, and every valid key.
        TypeError: ``config_class`` is not a dataclass.
    """
    valid = sorted(loop_config_keys(config_class))
    unknown = [str(k) for k in keys if k not in valid]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"{loop_name} config has unknown keys {', '.join(parts)}; valid keys: {', '.join(valid)}")
