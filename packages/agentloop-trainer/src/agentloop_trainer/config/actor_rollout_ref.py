"""The ``actor_rollout_ref`` section of the config (verl's layout): the trained policy, the
rollout (engine, sampling, multi-turn tool loops, agent loops) and the KL reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """Token budget of one micro-batch with ``use_dynamic_bsz``, counted as the forward pays it:
    rows x longest row (a longer row still gets a micro-batch of its own)."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Rows per no-grad pass when recomputing old and reference log-probs; null: as
    ``ppo_micro_batch_size_per_gpu`` (and ``use_dynamic_bsz``)."""
    fsdp_config: ActorFSDPSection = field(default_factory=lambda: ActorFSDPSection())
    """Sharding and offload of the policy and the reference."""


def _tool_loop_default(name: str) -> Any:
    """The tool loop's own default of ``name`` (:class:`agentloop_tools.loop_config.ToolAgentConfig`):
    the trainer declares no second default for a tool-loop setting it does not choose itself."""
    from agentloop_tools.loop_config import ToolAgentConfig

    return ToolAgentConfig.__dataclass_fields__[name].default


@dataclass
class MultiTurnSection:
    """Multi-turn settings of the tool loops (verl: ``rollout.multi_turn``). Each key reaches the
    loops' config (``agentloop_tools.loop_config.ToolAgentConfig``) under the same name, with the
    loop's default unless the trainer chooses its own (``max_assistant_turns``)."""

    enable: bool = True
    """verl's switch; agentloop's loops are always multi-turn (false is an error)."""
    max_assistant_turns: int | None = 3
    """Most model turns per trajectory; null: bounded by the response budget. The trainer's
    choice (the loop's own default is null): the built-in task needs two or three."""
    max_user_turns: int | None = _tool_loop_default("max_user_turns")
    """Most interaction (user) replies; null: until the interaction ends the conversation."""
    allow_special_tokens_in_content: bool = _tool_loop_default("allow_special_tokens_in_content")
    """Encode special-token strings (``<|im_start|>``...) inside tool results, observations and
    user turns as control tokens, as verl and vLLM do; false (the default): as plain text, so
    text from outside cannot forge turns. The model's own generated ids are never re-encoded."""
    max_parallel_calls: int = _tool_loop_default("max_parallel_calls")
    """Most tool calls run per turn; later calls get an error message."""
    max_tool_response_length: int | None = _tool_loop_default("max_tool_response_length")
    """Most characters of one tool response shown to the model; null: no character limit."""
    max_tool_response_tokens: int | None = _tool_loop_default("max_tool_response_tokens")
    """Most tokens (of the model's tokenizer, the truncation marker included) of one tool
    response shown to the model; null: no token limit. Both limits apply when both are set."""
    tool_response_truncate_side: str = _tool_loop_default("tool_response_truncate_side")
    """left (keep the tail) | right (keep the head) | middle (keep both ends)."""
    max_tokens_per_turn: int = 64
    """Most tokens one assistant turn may generate: the rollout's ``SamplingParams.max_tokens``."""
    tool_config_path: str | None = None
    """Tool YAML (native, function and MCP tools; see ``agentloop_tools.load_tools``); null: no
    tools, or the calculator for the built-in task."""
    function_tool_path: str | None = None
    """Python file whose module-level ``@function_tool`` functions become tools."""
    interaction_config_path: str | None = None
    """Interaction YAML (a simulated user that replies when the model stops calling tools)."""
    tool_parser: str = _tool_loop_default("tool_parser")
    """Tool-call parser (see ``agentloop_core.parsers.tool_parser_names()``; verl: ``format``)."""
    reasoning_parser: str | None = _tool_loop_default("reasoning_parser")
    """Reasoning parser that keeps the tool parser out of each turn's reasoning: qwen3 (alias qwq)
    | deepseek_r1 | gpt_oss (alias harmony); null: none (see
    ``agentloop_core.reasoning.reasoning_parser_names()``)."""
    tool_calls_in_reasoning: bool = _tool_loop_default("tool_calls_in_reasoning")
    """Run the calls written inside the reasoning too; false: counted
    (``tool_calls_in_reasoning_ignored``), not run."""
    tool_timeout_s: float | None = _tool_loop_default("tool_timeout_s")
    """Time limit of one tool call unless the tool sets its own."""


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
    turns_per_loop_iteration: int | None = 4
    """Most samples started, and most turns resumed after their engine call or their tool calls
    (``agentloop_core.turn_slot``), per event-loop iteration of a rollout worker: keeps the loop
    responsive (timers, tool timeouts) with thousands of trajectories in flight; null: no pacing."""
    hold_full_gc: bool = True
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
