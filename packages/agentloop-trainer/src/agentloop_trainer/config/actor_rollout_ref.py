"""The ``actor_rollout_ref`` section of the config (verl's layout): the trained policy, the
rollout (engine, sampling, multi-turn tool loops, agent loops) and the KL reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop_core.settings import DEFAULT_TURNS_PER_LOOP_ITERATION, RolloutConfig
from agentloop_trainer.config.multi_turn import MultiTurnSection

__all__ = [
    "ActorFSDPSection", "ActorRolloutRefSection", "ActorSection", "AgentSection", "MultiTurnSection",
    "PolicyLossSection", "RefFSDPSection", "RefSection", "RolloutSection", "TraceSection", "ValKwargsSection",
]


def _engine_kwargs_sections() -> dict[str, Any]:
    from agentloop_core.engine_registry import engine_names

    return {name: {} for name in engine_names(include_broken=True)}


@dataclass
class ActorFSDPSection:
    """FSDP2 settings of the policy and reference (verl: ``actor.fsdp_config``)."""

    param_offload: bool = False
    """Keep parameters, gradients and optimizer state in host memory between uses (FSDP2's
    ``CPUOffloadPolicy``, which offloads the three together; the optimizer step runs on the
    CPU). On one process the policy is then sharded over a one-rank group."""
    optimizer_offload: bool = False
    """Same switch as ``param_offload`` (FSDP2 offloads parameters and optimizer state together)."""
    offload_policy: bool = False
    """verl's FSDP2 spelling of the same switch."""


@dataclass
class PolicyLossSection:
    """Which policy loss (verl: ``actor.policy_loss``)."""

    loss_mode: str = "vanilla"
    """A name in the loss table (``update.losses.POLICY_LOSSES``; add one with
    ``register_policy_loss``): vanilla (PPO-clip on each token's ratio) | gspo (on its sequence's
    length-normalised ratio; use GSPO's small clip ranges, e.g. ``clip_ratio_low=0.0003
    clip_ratio_high=0.0004``, and ``loss_agg_mode=seq-mean-token-mean``, the paper's objective and
    what verl always uses for gspo)."""


@dataclass
class ActorSection:
    """GRPO actor (verl: ``actor_rollout_ref.actor``)."""

    lr: float = 1e-4
    """AdamW learning rate (verl: ``actor.optim.lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay (verl: ``actor.optim.weight_decay``)."""
    clip_ratio_low: float = 0.2
    """PPO ratio floor is 1 - this."""
    clip_ratio_high: float = 0.2
    """PPO ratio ceiling is 1 + this."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum. A trajectory split into segments
    counts once: token-mean weights each generated token once, the seq-mean modes take the
    whole trajectory as the sequence."""
    use_kl_loss: bool = False
    """Add a k3 KL term to a frozen reference policy."""
    kl_loss_coef: float = 0.001
    """Weight of the KL term."""
    tis_cap: float | None = 2.0
    """Cap of the rollout-vs-trainer importance weight per token; null disables it. The same as
    ``algorithm.rollout_correction.rollout_is=token`` with ``rollout_is_threshold`` = this cap; set
    it null to use ``rollout_is`` (token or sequence)."""
    policy_loss: PolicyLossSection = field(default_factory=lambda: PolicyLossSection())
    """The policy loss (``loss_mode``)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step, as in verl (each brings ``rollout.n`` samples; a mini-batch
    is that many rows, so trajectories split into segments take more steps); null: one update
    per batch."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Rows per forward/backward pass on each rank; gradients accumulate over a rank's
    micro-batches before the optimizer step (same result as one pass); null: a rank's whole
    share of the mini-batch in one pass."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget (``ppo_max_token_len_per_gpu``) instead of row count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch with ``use_dynamic_bsz`` (or with ``use_remove_padding`` and
    no ``ppo_micro_batch_size_per_gpu``), counted as the forward pays it: rows x longest row when
    padded, the sum of the rows' tokens when packed (a longer row still gets a micro-batch of its
    own)."""
    use_remove_padding: bool = True
    """Padding-free updates (verl: ``actor_rollout_ref.model.use_remove_padding``): each
    micro-batch of a text model runs as one packed row, its sequences concatenated with position
    ids restarting at 0 and attention kept within each sequence, in the log-prob passes (old and
    reference) and the update. Vision-language models always run padded. False: pad every
    micro-batch to its longest row (and share the rows' common prompt prefix instead)."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Rows per no-grad pass when recomputing old and reference log-probs; null: as
    ``ppo_micro_batch_size_per_gpu`` (and ``use_dynamic_bsz``)."""
    fsdp_config: ActorFSDPSection = field(default_factory=lambda: ActorFSDPSection())
    """Sharding and offload of the policy and the reference."""


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
    their own choice, which runs a float32 checkpoint in float16). null: float32, what the
    trainer's log-probs are computed against (also with ``model.dtype=bfloat16``: a bfloat16
    engine is measured no closer to its mixed-precision log-probs; see
    :func:`agentloop_trainer.rollout.engines.rollout_dtype`). A one-line notice when it differs from
    ``model.dtype``."""
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
    """Put engines that support it to sleep (weights and KV cache off the GPU) during the
    update, and wake them before the weight sync."""
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
class RefFSDPSection:
    """FSDP2 settings of the reference policy (verl: ``ref.fsdp_config``)."""

    param_offload: bool = False
    """Keep the reference's shards in host memory (also on when the actor offloads)."""


@dataclass
class RefSection:
    """The frozen reference policy of the KL loss (verl: ``actor_rollout_ref.ref``). With LoRA
    there is none: the reference is the policy with its adapters disabled."""

    fsdp_config: RefFSDPSection = field(default_factory=RefFSDPSection)
    """Sharding and offload of the reference."""


@dataclass
class ActorRolloutRefSection:
    """Actor, rollout and reference (verl layout)."""

    actor: ActorSection = field(default_factory=ActorSection)
    """The trained policy."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """The rollout engine and loop."""
    ref: RefSection = field(default_factory=RefSection)
    """The KL reference."""
