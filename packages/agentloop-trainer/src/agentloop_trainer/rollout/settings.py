"""The rollout's sections: ``actor_rollout_ref.rollout`` (engine, sampling, multi-turn tool loops,
agent loops, tracing), ``algorithm.filter_groups`` (DAPO's dynamic sampling) and ``ray``, and
their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentloop_core.settings import DEFAULT_TURNS_PER_LOOP_ITERATION, RolloutConfig
from agentloop_trainer.config_base import Check, ConfigError, require
from agentloop_trainer.loggers import missing_package
from agentloop_trainer.rollout.multi_turn import MultiTurnSection

if TYPE_CHECKING:
    from agentloop_core.engine_registry import EnginePlugin

AS_MODEL = "model"
"""``actor_rollout_ref.rollout.dtype`` value: the engine runs in ``model.dtype`` as resolved for
the device (``model.dtype=auto``: bfloat16 where it is native, float32 elsewhere)."""

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16", "auto", AS_MODEL)
"""Values of ``actor_rollout_ref.rollout.dtype`` (besides null)."""

TRACE_BACKENDS = (None, "mlflow", "jsonl")
"""Values of ``actor_rollout_ref.rollout.trace.backend`` (verl's weave is not one)."""

FILTER_METRICS: tuple[str, ...] = ("acc", "score", "seq_reward", "seq_final_reward")
"""Values of ``algorithm.filter_groups.metric``: per-trajectory quantities a group's spread is
measured on (:func:`agentloop_trainer.rollout.dynamic_sampling.trajectory_metric`)."""

ON_LIMIT: tuple[str, ...] = ("error", "train_kept")
"""Values of ``algorithm.filter_groups.on_limit``."""


@dataclass
class FilterGroupsSection:
    """Dynamic sampling (DAPO; verl: ``algorithm.filter_groups``): a GRPO group whose samples all
    have the same ``metric`` teaches nothing (every advantage is 0), so it is dropped and more
    prompts are rolled out until ``data.train_batch_size`` groups with a spread are kept."""

    enable: bool = False
    """Drop all-equal groups and draw more prompt batches to fill the step."""
    metric: str = "acc"
    """What must differ within a group: acc (the reward function's ``acc`` when it returns one,
    else the reward before over-long shaping) | score (the reward before over-long shaping) |
    seq_reward | seq_final_reward (the reward after it; the same here, as agentloop puts no KL
    in the reward)."""
    max_num_gen_batches: int = 0
    """Most prompt batches (of ``data.train_batch_size`` prompts) rolled out for one step; 0: no
    limit (verl's meaning: draw until the step is full, however long that takes)."""
    on_limit: str = "error"
    """What a sync step does when ``max_num_gen_batches`` batches kept too few groups: error (as
    verl: stop the run, naming the counts) | train_kept (train on the groups kept, fewer than
    ``data.train_batch_size``, with a warning). agentloop's key; asynchronous modes: error only."""



def _engine_kwargs_sections() -> dict[str, Any]:
    from agentloop_core.engine_registry import engine_names

    return {name: {} for name in engine_names(include_broken=True)}


@dataclass
class AgentSection:
    """Agent loops and their workers (verl: ``rollout.agent``)."""

    num_workers: int = 1
    """Workers a batch is split over."""
    default_agent_loop: str = "tool_agent"
    """Loop of rows without an ``agent_name`` column."""
    agent_loop_config_path: str | None = None
    """verl-style YAML list of ``{name, _target_}`` (``_target_``: ``pkg.module.Class``) that
    registers user loops by import path."""
    agent_loop_modules: list[str] = field(default_factory=list)
    """Modules to import so their ``@register`` loops exist (also on Ray workers)."""
    turns_per_loop_iteration: int | None = DEFAULT_TURNS_PER_LOOP_ITERATION
    """Most samples started, and most turns resumed after their engine call or their tool calls
    (``agentloop_core.turn_slot``), per event-loop iteration of a rollout worker: keeps the loop
    responsive (timers, tool timeouts) with thousands of trajectories in flight; null: no pacing."""
    # The record's own default (a dataclass keeps a field's default as the class attribute).
    hold_full_gc: bool = RolloutConfig.hold_full_gc
    """While a rollout batch is in flight, freeze what existed before it and hold off Python's
    full garbage collections (young ones still run): with thousands of trajectories each full
    collection paused every loop for 0.2-0.7 s; false: Python's own schedule."""
    switch_interval_s: float | None = RolloutConfig.switch_interval_s
    """While a rollout batch is in flight, the interpreter's thread switch interval is at most
    this (Python's default: 0.005 s): a sync tool's threads then get the GIL from a busy loop
    sooner; at 16384 trajectories a calculator call took 35 ms instead of 228 (median) and the
    loop's lag p99 fell from 61-70 to 17-19 ms; null: left as it is."""
    loops: dict[str, Any] = field(default_factory=dict)
    """Per-loop settings merged over the common ones, e.g. ``loops.react_agent.graph_factory``;
    ``loops.<name>._target_`` registers a loop class by import path. Unknown keys are errors."""


@dataclass
class ValKwargsSection:
    """Sampling of validation rollouts (verl: ``rollout.val_kwargs``)."""

    temperature: float = 0.0
    """0: greedy."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1.0 disables nucleus sampling."""
    do_sample: bool = False
    """false forces greedy whatever the temperature (verl's meaning)."""
    n: int = 1
    """Samples per held-out prompt: ``eval/accuracy`` and ``avg@n`` are their mean reward;
    pass@k is reported for k = 1, the powers of two below n, and n; maj@n where the scorer
    extracts answers (sample with ``do_sample=true`` and a temperature for n > 1 to mean anything)."""


@dataclass
class TraceSection:
    """Rollout tracing (verl's keys, verl: ``rollout.trace``): one trace per trajectory, with a
    span for every generate, tool call and reward, tagged with step, sample_index and rollout_n."""

    backend: str | None = None
    """null: no tracing | mlflow: traces in the MLflow store of ``trainer.mlflow_tracking_uri``,
    else ``$MLFLOW_TRACKING_URI``, else ``<run>/mlflow.db`` | jsonl: ``<run>/traces.jsonl``."""
    token2text: bool = False
    """Also store each trajectory's prompt and response as decoded text on its root span."""
    max_samples_per_step_per_worker: int | None = None
    """Trace at most this many prompts (each with all its ``rollout.n`` samples) per step, per
    rollout worker on Ray, per trainer process in process; null: every trajectory."""
    project_name: str | None = None
    """MLflow experiment the traces go to; null: ``trainer.project_name`` (as in verl)."""


@dataclass
class RolloutSection:
    """Rollout (verl: ``actor_rollout_ref.rollout``)."""

    name: str = "hf"
    """Engine: an installed engine plug-in (``agentloop.engines`` entry points): agentloop-engines'
    hf (transformers, CPU or GPU), vllm and sglang, or a third party's."""
    server_urls: list[str] | None = None
    """Already-running agentloop engine HTTP servers (``agentloop_engines.serve``) to roll out
    on instead of starting an engine; weights are pushed to them after each update."""
    server_api_key_env: str | None = None
    """Environment variable holding the servers' bearer token (kept out of config files)."""
    server_control_key_env: str | None = None
    """Environment variable holding the servers' control key (``agentloop serve
    --control-key-env``): what pushing weights, sleep, wake-up and abort need; the chat
    ``api_key`` never opens them. null: those calls fail naming this key."""
    server_max_response_bytes: int = 64 * 1024 * 1024
    """Most bytes of one answer (a streamed one in total) read from a server in
    ``server_urls``: past it the call fails naming this key, so a broken or hostile server
    cannot fill this process's memory."""
    dtype: str | None = None
    """Dtype the rollout engine runs in: float32 | bfloat16 | float16 | auto (vllm/sglang only:
    their own choice, which runs a float32 checkpoint in float16) | model (``model.dtype`` as
    resolved for the device: with ``model.dtype=auto``, bfloat16 where the device computes it
    natively, float32 elsewhere; on a CPU with AVX512_BF16 a bfloat16 HFServer ran the
    real-model recipe's held-out evaluation in 0.73x the time, peaking at 3.73 GB against 4.89,
    bench/README 10h). null: float32, what the trainer's log-probs are computed against (also
    with ``model.dtype=bfloat16``: a bfloat16 engine is measured no closer to its
    mixed-precision log-probs; see :func:`agentloop_trainer.rollout.engines.rollout_dtype`). A
    one-line notice when it differs from ``model.dtype`` (none with ``model``)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM/SGLang may take (SGLang: ``mem_fraction_static``)."""
    tensor_model_parallel_size: int = 1
    """GPUs one engine replica spans."""
    enforce_eager: bool = True
    """vLLM: no CUDA graphs / torch.compile (fast start-up)."""
    max_model_len: int | None = None
    """Engine context length; null: prompt + response budget for an engine that reserves KV cache
    for its whole context (its plug-in's ``capabilities.reserves_kv_cache``: vllm, sglang), else
    the model's."""
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: _engine_kwargs_sections())
    """Extra constructor arguments per engine (``engine_kwargs.vllm.enable_prefix_caching=true``);
    one empty section per installed engine."""
    n: int = 8
    """Samples per prompt (GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1.0 disables nucleus sampling."""
    max_batch_size: int = 128
    """Requests the hf engine decodes together."""
    backend: str = "inprocess"
    """inprocess: one engine and the rollout workers in the trainer process (fastest on one small
    machine); ray: engine replicas and rollout workers as Ray actors (set by ``ray.address``)."""
    num_replicas: int = 1
    """Engine replicas (ray backend), each in its own placement-group bundle."""
    free_cache_engine: bool = True
    """Put engines that support it to sleep (weights and KV cache off the GPU; a CPU HFServer's
    prefix cache dropped) during the update, and wake them before the weight sync."""
    enable_prefix_caching: bool = True
    """Engines reuse the keys and values of a prompt prefix they already computed (vLLM's
    prefix caching, SGLang's radix cache, HFServer: a trajectory's earlier turns), so a turn
    prefills only its new tokens. Exact; the caches are dropped on every weight update (and
    during the update, with ``free_cache_engine``)."""
    update_weights_bucket_megabytes: float = 512.0
    """Weights are pushed to the engines in buckets of about this size: under FSDP each tensor
    is gathered on its own, so a push holds one bucket beyond the model, never a second copy."""
    sanity_check: str = "ignore_strippable"
    """Delta-tokenization check: strict | ignore_strippable | disable (verl:
    ``multi_turn.tokenization_sanity_check_mode``)."""
    sample_timeout_s: float | None = None
    """A trajectory running longer fails (counted in rollout/num_failed); null: no limit."""
    val_kwargs: ValKwargsSection = field(default_factory=ValKwargsSection)
    """Validation sampling."""
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    """Multi-turn settings."""
    agent: AgentSection = field(default_factory=AgentSection)
    """Agent loops and workers."""
    trace: TraceSection = field(default_factory=TraceSection)
    """Rollout tracing."""



@dataclass
class RaySection:
    """Ray cluster and placement (used when ``rollout.backend=ray``)."""

    address: str | None = None
    """Cluster to join: ``auto``, ``ray://host:10001`` or ``host:6379`` (setting it selects the ray
    backend); None: start a local Ray cluster on this machine."""
    num_cpus: int | None = None
    """CPUs of a local cluster; None: all of this machine's."""
    listen_on_network: bool = False
    """A local cluster (no ``address``) listens on every address of this machine, for other
    machines to join it; its authentication is off, so only on a network you trust. False: on
    127.0.0.1 only. Ignored when joining a cluster."""
    placement_strategy: str = "PACK"
    """PACK | SPREAD | STRICT_PACK | STRICT_SPREAD for engine replicas and FSDP ranks."""
    replica_num_cpus: float = 1.0
    """CPUs each engine replica reserves."""
    replica_num_gpus: float = 0.0
    """GPUs each engine replica reserves (its tensor-parallel size on GPU engines)."""
    worker_placement: str = "spread"
    """spread: rollout workers round-robin over alive nodes (soft affinity); default: Ray decides."""
    rank_num_cpus: float = 1.0
    """CPUs each FSDP rank reserves (``trainer.launcher=ray``)."""
    rank_num_gpus: float = 0.0
    """GPUs each FSDP rank reserves (``trainer.launcher=ray``)."""



def uses_ray(rollout: RolloutSection, ray: RaySection) -> bool:
    """Whether the rollout runs on Ray: ``rollout.backend=ray`` or a ``ray.address`` to join."""
    return rollout.backend == "ray" or ray.address is not None


def engine_plugin(rollout: RolloutSection) -> EnginePlugin:
    """The installed engine plug-in ``actor_rollout_ref.rollout.name`` names.

    Raises:
        ConfigError: no installed engine has that name (listing those that are, and how to add
            one), or its plug-in failed to load.
    """
    from agentloop_core.engine_registry import UnknownEngineError, get_engine_plugin

    try:
        return get_engine_plugin(rollout.name)
    except UnknownEngineError as exc:
        raise ConfigError(f"config actor_rollout_ref.rollout.name must be one of the installed engines ({exc})") from None


def check(rollout: RolloutSection, ray: RaySection, *, mode: str) -> None:
    """Range and choice checks of ``actor_rollout_ref.rollout`` and ``ray`` (``mode``:
    ``trainer.mode``, whose asynchronous modes need an engine that returns partial rollouts).

    Raises:
        ConfigError: naming the key and what it must be.
    """
    from agentloop_engines.fleet.hosting import PLACEMENT_STRATEGIES

    r, on_ray = rollout, uses_ray(rollout, ray)
    require([
        ("actor_rollout_ref.rollout.n", r.n >= 1, "at least 1 (2+ for GRPO)"),
        ("actor_rollout_ref.rollout.backend", r.backend in ("inprocess", "ray"), "inprocess or ray"),
        ("actor_rollout_ref.rollout.num_replicas", r.num_replicas >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.trace.backend", r.trace.backend in TRACE_BACKENDS,
         f"null, {' or '.join(map(str, TRACE_BACKENDS[1:]))} (agentloop traces to MLflow or a JSONL file), "
         f"got {r.trace.backend!r}"),
        ("actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker",
         r.trace.max_samples_per_step_per_worker is None or r.trace.max_samples_per_step_per_worker >= 0,
         "null (every trajectory) or >= 0"),
        ("actor_rollout_ref.rollout.num_replicas", r.num_replicas == 1 or on_ray,
         "1 with the inprocess backend (set actor_rollout_ref.rollout.backend=ray or ray.address for more)"),
        ("ray.placement_strategy", ray.placement_strategy in PLACEMENT_STRATEGIES,
         f"one of {', '.join(PLACEMENT_STRATEGIES)}"),
        ("ray.worker_placement", ray.worker_placement in ("spread", "default"), "spread or default"),
    ])
    engine = engine_plugin(r)
    dtypes = engine.capabilities.dtypes
    require([
        ("actor_rollout_ref.rollout.dtype", r.dtype is None or r.dtype in ROLLOUT_DTYPES,
         f"null (float32) or one of {ROLLOUT_DTYPES}"),
        ("actor_rollout_ref.rollout.dtype",
         r.dtype is None or r.dtype in dtypes or (r.dtype == AS_MODEL and {"float32", "bfloat16"} <= set(dtypes)),
         f"{', '.join(dtypes)} or null with rollout.name={r.name} (the dtypes its plug-in declares in "
         "capabilities.dtypes; auto, the engine's own choice, only where declared)"),
        ("actor_rollout_ref.rollout.server_urls", not r.server_urls or not on_ray,
         "unset with the ray backend (remote servers are routed from the trainer process)"),
        ("actor_rollout_ref.rollout.multi_turn.enable", r.multi_turn.enable,
         "true (agentloop's loops are multi-turn; a loop that stops after one turn is still one)"),
        *((f"actor_rollout_ref.rollout.multi_turn.{key}",
           getattr(r.multi_turn, key) is None or getattr(r.multi_turn, key) >= 1, "null or at least 1")
          for key in ("max_tool_response_length", "max_tool_response_tokens")),
        ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
         r.multi_turn.tool_response_truncate_side in ("left", "right", "middle"), "left, right or middle"),
        ("actor_rollout_ref.rollout.sanity_check", r.sanity_check in ("strict", "ignore_strippable", "disable"),
         "strict, ignore_strippable or disable"),
        ("actor_rollout_ref.rollout.val_kwargs.n", r.val_kwargs.n >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.agent.turns_per_loop_iteration",
         r.agent.turns_per_loop_iteration is None or r.agent.turns_per_loop_iteration >= 1, "null or at least 1"),
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", r.update_weights_bucket_megabytes > 0, "> 0"),
    ])
    _check_sampling(r)
    if r.trace.backend == "mlflow" and missing_package("mlflow"):
        raise ConfigError("config actor_rollout_ref.rollout.trace.backend=mlflow, but its package is not installed: "
                          f"{missing_package('mlflow')}")
    if mode != "sync":
        _check_partial_rollout(r, engine, mode)


def _check_sampling(r: RolloutSection) -> None:
    """The sampling keys checked by core's ``SamplingParams`` (the one validator every entry
    point uses) at load, not when the rollout starts: NaN or inf, out of range, wrong type."""
    from agentloop_core.protocol import SamplingParams

    prefix = "actor_rollout_ref.rollout."
    keys = {  # config key -> (SamplingParams field, value)
        prefix + "temperature": ("temperature", r.temperature), prefix + "top_k": ("top_k", r.top_k),
        prefix + "top_p": ("top_p", r.top_p),
        prefix + "multi_turn.max_tokens_per_turn": ("max_tokens", r.multi_turn.max_tokens_per_turn),
        prefix + "val_kwargs.temperature": ("temperature", r.val_kwargs.temperature),
        prefix + "val_kwargs.top_k": ("top_k", r.val_kwargs.top_k),
        prefix + "val_kwargs.top_p": ("top_p", r.val_kwargs.top_p),
    }
    for key, (name, value) in keys.items():
        try:
            SamplingParams.from_mapping({name: value})
        except ValueError as exc:
            raise ConfigError(f"config {key}: {exc}") from exc
    if not isinstance(r.val_kwargs.do_sample, bool):
        raise ConfigError(f"config {prefix}val_kwargs.do_sample must be true or false, got {r.val_kwargs.do_sample!r}")


def _check_partial_rollout(r: RolloutSection, engine: EnginePlugin, mode: str) -> None:
    """What the asynchronous modes need of the engine.

    Partial rollout needs an engine whose abort returns the tokens generated so far (with
    their log-probs): its plug-in says so (capabilities.partial_rollout). Our HTTP engine
    server in front of such an engine (rollout.server_urls) is verified too, and so are Ray
    replicas (the wrapper then lives in the shared client actor every rollout worker calls
    through). Under FSDP the driver runs on rank 0, which hosts the engine; the other ranks
    follow its updates and weight pushes.
    """
    from agentloop_core.engine_registry import engine_names, get_engine_plugin

    able = [n for n in engine_names() if get_engine_plugin(n).capabilities.partial_rollout]
    if not (bool(r.server_urls) or engine.capabilities.partial_rollout):
        raise ConfigError(
            f"config actor_rollout_ref.rollout.name must be one of the engines whose plug-in declares "
            f"capabilities.partial_rollout ({', '.join(able)}; not {r.name}: an engine declares it when its abort "
            "returns the tokens generated so far, with their log-probs, and a resumed request continues from them) "
            f"with trainer.mode={mode}; or use trainer.mode=sync for this setup")


def filter_groups_checks(fg: FilterGroupsSection, *, n: int, mode: str) -> list[Check]:
    """Checks of dynamic sampling (``algorithm.filter_groups``), given ``rollout.n`` and ``trainer.mode``."""
    return [
        ("algorithm.filter_groups.metric", fg.metric in FILTER_METRICS,
         f"one of {FILTER_METRICS} (a per-trajectory quantity agentloop defines), got {fg.metric!r}"),
        ("algorithm.filter_groups.max_num_gen_batches", fg.max_num_gen_batches >= 0,
         f">= 0 (0: no limit), got {fg.max_num_gen_batches}"),
        ("algorithm.filter_groups.on_limit", fg.on_limit in ON_LIMIT, f"one of {ON_LIMIT}, got {fg.on_limit!r}"),
        ("algorithm.filter_groups.on_limit", not fg.enable or fg.on_limit == "error" or mode == "sync",
         f"error with trainer.mode={mode} (a step there trains data.train_batch_size groups from "
         "the buffer); train_kept is for trainer.mode=sync"),
        ("actor_rollout_ref.rollout.n", not fg.enable or n >= 2,
         f"at least 2 with algorithm.filter_groups.enable=true (a group of one sample never has a spread), "
         f"got {n}"),
    ]
