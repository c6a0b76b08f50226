"""The training config: OmegaConf structured defaults with verl-familiar names.

``agentloop train key=value ...`` overrides any leaf. An unknown or mistyped key is an error
that names the key and the closest valid one, never a silently ignored setting.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DataSection:
    """Datasets (verl: ``data``)."""

    train_files: Any = None
    """Parquet file (or list of files) of training rows; None: the built-in calculator task."""
    val_files: Any = None
    """Parquet file (or list of files) of held-out rows; None: the built-in calculator task."""
    train_size: int = 20000
    """Synthetic training problems."""
    val_size: int = 200
    """Synthetic held-out problems."""
    train_seed: int = 1
    """Seed of the synthetic training split."""
    val_seed: int = 2
    """Seed of the synthetic held-out split (disjoint questions from training are enforced)."""
    train_batch_size: int = 16
    """Prompts per GRPO step."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, counted with the chat template and the rollout's tool schemas."""
    filter_overlong_prompts: bool = True
    """Drop longer prompts (the count is logged and kept in summary.json); false: a longer
    prompt is an error naming the row."""
    max_response_length: int = 128
    """Token budget of a response (generated + tool tokens)."""
    shuffle: bool = True
    """Shuffle training rows each epoch."""


@dataclass
class ModelSection:
    """The policy (verl: ``actor_rollout_ref.model``)."""

    path: str | None = None
    """Hugging Face checkpoint folder to start GRPO from; None: build the tiny model and its
    SFT warm-up checkpoint (cached on disk)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None: the model folder, or the tiny tokenizer."""
    custom_chat_template: str | None = None
    """The chat template every tokenizer of the run gets (trainer, loops, Ray workers, engines,
    exported folders): a built-in name (``chatml-hermes``, ``llama3-json``), a path to a Jinja
    file, or the template text; None: the tokenizer's own. Set it when the model's template
    ignores ``tools=``."""
    dtype: str = "float32"
    """Parameters and compute of the trained policy: float32 | bfloat16. bfloat16 is mixed
    precision: master weights, gradient reduction and optimizer state stay float32 (FSDP2
    gathers bfloat16 parameters; one process computes under autocast)."""
    enable_gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    lora_rank: int = 0
    """LoRA rank (peft); 0: train every weight. With LoRA only the adapters train, engines get
    merged weights, and the KL reference is the base model with the adapter disabled."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)."""
    target_modules: Any = "all-linear"
    """Modules that get adapters: a list of names (``[q_proj, v_proj]``) or ``all-linear``."""


@dataclass
class SFTSection:
    """Supervised fine-tuning: the general stage (``sft.train_files``: ``agentloop sft``, or
    the first stage of ``agentloop train``) and the tiny model's warm-up on (biased) teacher
    demonstrations (no ``model.path``, no ``sft.train_files``). Keys shared by both: batch_size,
    micro_batch_size, lr, warmup_steps, weight_decay, grad_clip, seed."""

    steps: int = 750
    """Warm-up: optimizer steps of the learning-rate schedule (linear warm-up, cosine decay to 10%)."""
    stop_loss: float | None = 0.02
    """Warm-up: the demonstrations count as learned when the mean loss of the schedule's last 50
    steps is below this (the teacher's coin flips on the biased templates keep it above ~0.005).
    When they are not, the schedule runs again from the start (a warm restart), up to
    ``max_steps`` in all: how long the loss sits on a plateau before it falls varies
    several-fold with the seed, so one fixed length is either slow for most seeds or too short
    for some. null: run the schedule once."""
    max_steps: int = 1500
    """Warm-up: most optimizer steps in all (whole schedules only)."""
    batch_size: int = 32
    """Conversations per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, cosine decay to 10%). The default is the tiny
    model's; a pretrained checkpoint wants ~1e-5 (full) or ~1e-4 (LoRA)."""
    warmup_steps: int = 50
    """Warm-up steps of the learning-rate schedule (of each run of it, for the tiny warm-up)."""
    flip_prob: float = 0.6
    """Warm-up: chance the teacher flips the last operator on a biased template."""
    seed: int = 0
    """Seed of the model init (tiny model), the data order, the demonstration stream and the
    teacher's mistakes."""
    train_files: Any = None
    """SFT conversations: a parquet or jsonl file, or a list of them, in verl's multi-turn SFT
    layout (a ``messages`` column; assistant messages may carry OpenAI ``tool_calls``; ``tool``
    messages hold the results; optional ``tools``: a list of JSON schemas or a JSON string of
    one). Set, ``agentloop train`` first fine-tunes ``model.path`` (or the tiny model) on them
    into ``<run>/sft/`` and runs GRPO from the result. ``agentloop data calculator-sft`` writes
    such a file for the calculator task."""
    val_files: Any = None
    """Held-out SFT conversations (same layout): their loss is logged as ``sft/val_loss``."""
    epochs: int = 1
    """Passes over ``train_files`` (when ``total_steps`` is null)."""
    total_steps: int | None = None
    """Optimizer steps of the general stage; null: ``epochs`` passes over the data (a partial
    batch at an epoch's end is dropped)."""
    micro_batch_size: int | None = None
    """Conversations per forward/backward; gradients accumulate over ``batch_size``. null: the
    whole batch at once."""
    max_length: int = 2048
    """Longest conversation in tokens (chat template and tool schemas included)."""
    filter_overlong: bool = True
    """Drop conversations longer than ``max_length`` (the count is logged and kept in the
    summary); false: a longer one is an error naming the row."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    save_freq: int = 0
    """Checkpoint (weights, optimizer state, step, data position) every this many steps into
    ``<sft>/checkpoints/``; 0: never (the final Hugging Face folder is always written)."""
    test_freq: int = 0
    """Held-out loss every this many steps (0: only at the end); needs ``val_files``."""
    output_dir: str | None = None
    """The stage's folder; null: ``<run>/sft`` (the run folder as ``agentloop train`` names it).
    The fine-tuned model lands in ``<folder>/hf``."""
    resume: str = "never"
    """never | auto | must (``agentloop sft --resume``): continue from the stage's latest
    checkpoint. Under ``agentloop train`` a finished stage (``<sft>/hf``) is always reused."""
    eval_before: bool = False
    """``agentloop train`` with ``train_files``: also evaluate ``model.path`` on the held-out
    split before SFT (``eval_accuracy_before_sft`` in summary.json; after SFT is GRPO's
    ``eval_accuracy_before``)."""


@dataclass
class FSDPConfigSection:
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
    """Cap of the rollout-vs-trainer importance weight; null disables the correction."""
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
    fsdp_config: FSDPConfigSection = field(default_factory=lambda: FSDPConfigSection())
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
    max_parallel_calls: int = _tool_loop_default("max_parallel_calls")
    """Most tool calls run per turn; later calls get an error message."""
    max_tool_response_length: int = _tool_loop_default("max_tool_response_length")
    """Most characters of one tool response shown to the model."""
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
    """Most samples started, and most turns resumed after their engine call, per event-loop
    iteration of a rollout worker: keeps the loop responsive (timers, tool timeouts) with
    thousands of trajectories in flight; null: no pacing."""
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
    """Samples per held-out prompt (the reported reward is their mean)."""


@dataclass
class RolloutSection:
    """Rollout (verl: ``actor_rollout_ref.rollout``)."""

    name: str = "hf"
    """Engine: hf (transformers, CPU or GPU) | vllm | sglang."""
    server_urls: list[str] | None = None
    """Already-running agentloop engine HTTP servers (``agentloop_engines.serve``) to roll out
    on instead of starting an engine; weights are pushed to them after each update."""
    server_api_key_env: str | None = None
    """Environment variable holding the servers' bearer token (kept out of config files)."""
    dtype: str | None = None
    """Dtype the rollout engine runs in: float32 | bfloat16 | float16 | auto (vllm/sglang only:
    their own choice, which runs a float32 checkpoint in float16). null: float32, what the
    trainer's log-probs are computed against (also with ``model.dtype=bfloat16``: a bfloat16
    engine is measured no closer to its mixed-precision log-probs; see
    :func:`agentloop_trainer.engines.rollout_dtype`). A one-line notice when it differs from
    ``model.dtype``."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM/SGLang may take (SGLang: ``mem_fraction_static``)."""
    tensor_model_parallel_size: int = 1
    """GPUs one engine replica spans."""
    enforce_eager: bool = True
    """vLLM: no CUDA graphs / torch.compile (fast start-up)."""
    max_model_len: int | None = None
    """Engine context length; null: prompt + response budget for vLLM/SGLang, the model's for hf."""
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: {"hf": {}, "vllm": {}, "sglang": {}})
    """Extra constructor arguments per engine (``engine_kwargs.vllm.enable_prefix_caching=true``)."""
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


@dataclass
class RefFSDPConfigSection:
    """FSDP2 settings of the reference policy (verl: ``ref.fsdp_config``)."""

    param_offload: bool = False
    """Keep the reference's shards in host memory (also on when the actor offloads)."""


@dataclass
class RefSection:
    """The frozen reference policy of the KL loss (verl: ``actor_rollout_ref.ref``). With LoRA
    there is none: the reference is the policy with its adapters disabled."""

    fsdp_config: RefFSDPConfigSection = field(default_factory=RefFSDPConfigSection)
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


@dataclass
class AlgorithmSection:
    """Advantage estimation (verl: ``algorithm``)."""

    adv_estimator: str = "grpo"
    """grpo (mean/std per group) | dr_grpo (mean only)."""


@dataclass
class CustomRewardFunctionSection:
    """A reward function from a Python file (verl: ``custom_reward_function``)."""

    path: str | None = None
    """Python file defining the function; null: the built-in scorer of each row's ``data_source``."""
    name: str = "compute_score"
    """Function name; signature ``(data_source, solution_str, ground_truth, extra_info)``, sync
    or async, returning a float or a dict with ``score`` (other numbers become metrics)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the function."""


@dataclass
class RewardSection:
    """How a trajectory's reward is put together."""

    source: str = "auto"
    """function: the reward function only | loop: the loop's own reward (tool ``calc_reward``
    and step rewards, interaction scores) | sum: both added | auto: the function when one
    applies (custom, or a built-in scorer for the row's data_source), else the loop's."""
    zero_reward_warn_steps: int = 3
    """Warn loudly when every reward has been zero for this many steps in a row (0: never); the
    first such step (or pre-RL evaluation) is reported at once too."""
    answer_format: dict[str, str] = field(default_factory=lambda: {"default": "strict"})
    """How the built-in scorers read a response's answer, per data_source (its full name or its
    tail: ``gsm8k`` covers ``openai/gsm8k``) with a ``default``: strict (only the task's canonical
    form, ``#### N`` or ``\\boxed{}``) | flexible (also "the answer is N", "answer: N",
    ``\\boxed{N}`` and the final number; the latest answer wins; commas, ``$`` and units ignored).
    Instruct models rarely write ``#### N`` unprompted: ``reward.answer_format.gsm8k=flexible``."""


@dataclass
class RaySection:
    """Ray cluster and placement (used when ``rollout.backend=ray``)."""

    address: str | None = None
    """Cluster to join: ``auto``, ``ray://host:10001`` or ``host:6379`` (setting it selects the ray
    backend); None: start a local Ray cluster on this machine."""
    num_cpus: int | None = None
    """CPUs of a local cluster; None: all of this machine's."""
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


@dataclass
class TrainerSection:
    """Run control (verl: ``trainer``)."""

    total_steps: int = 30
    """GRPO steps (verl: ``total_training_steps``; 30 keep the default job short on 2 CPU cores;
    the H200 runs in the README used 50)."""
    seed: int = 0
    """Seed of data order, sampling and the engine."""
    project_name: str = "agentloop"
    """Project (MLflow experiment name)."""
    experiment_name: str | None = None
    """Run name: outputs go to ``<output_dir>/<experiment_name>``; None: a timestamp."""
    output_dir: str = "outputs"
    """Parent folder of runs."""
    run_dir: str | None = None
    """The run folder itself (verl: ``default_local_dir``); null: ``<output_dir>/<experiment_name>``."""
    fsdp_ranks: int = 1
    """Trainer processes (FSDP2 over gloo on CPU, NCCL on GPU); 1: no sharding."""
    launcher: str = "spawn"
    """How FSDP ranks start: spawn (processes on this machine) or ray (actors in a placement
    group, possibly on several nodes)."""
    device: str = "cpu"
    """cpu or cuda."""
    test_freq: int = 10
    """Evaluate on the held-out split every this many steps (0 or -1: only before and after)."""
    val_before_train: bool = True
    """Evaluate before the first step."""
    save_freq: int = 25
    """Checkpoint every this many steps (0 or -1: never)."""
    save_hf: bool = True
    """At each checkpoint, also write the policy as a Hugging Face folder
    (``checkpoints/step_<N>/hf``: config, safetensors weights with LoRA merged, tokenizer),
    loadable by transformers, vLLM and ``agentloop eval``."""
    hf_max_shard_megabytes: int = 5000
    """Split the Hugging Face folder's weights into files of at most this many megabytes, listed
    in ``model.safetensors.index.json`` (``save_pretrained``'s ``max_shard_size``)."""
    resume: str = "never"
    """never: start from step 0; must (``--resume``): continue from the run's latest checkpoint
    and fail if it has none; auto (``--resume-or-start``): continue if there is one, else start.
    true and false are read as must and never."""
    mlflow_tracking_uri: str | None = None
    """Also log metrics to MLflow at this URI (e.g. sqlite:///mlflow.db)."""
    progress_bar: bool = True
    """Show a tqdm bar."""
    log_trajectories_per_step: int = 4
    """Sample trajectories written each step to ``<run>/trajectories/step_<N>.jsonl`` (the format of
    ``agentloop rollout``; ``agentloop view <run>`` renders them); failed ones are always written."""
    mode: str = "sync"
    """sync: each step rolls out its batch, then trains (the default) | one_step_off: the rollout
    of the next batch overlaps the update, generations finish on the weights they started on
    (max_staleness 1) | async: rollout runs continuously into a bounded buffer, and a weight
    update interrupts generations at a token boundary and resumes them on the new weights
    (partial rollout). The async modes support the hf and vllm engines (in process, on Ray, or
    behind rollout.server_urls), not sglang."""
    max_staleness: int | None = None
    """Most policy versions between the start of a GRPO group and the step that trains it; null:
    0 for sync, 1 for one_step_off and async. The rollout pauses when a new group could exceed it."""


@dataclass
class TrainConfig:
    """Everything ``agentloop train`` reads."""

    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    custom_reward_function: CustomRewardFunctionSection = field(default_factory=CustomRewardFunctionSection)
    reward: RewardSection = field(default_factory=RewardSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ray: RaySection = field(default_factory=RaySection)


ENGINE_NAMES = ("hf", "vllm", "sglang")
"""Values of ``actor_rollout_ref.rollout.name``."""
REWARD_SOURCES = ("auto", "function", "loop", "sum")
"""Values of ``reward.source``."""
TRAIN_DTYPES = ("float32", "bfloat16")
"""Values of ``model.dtype``."""
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16", "auto")
"""Values of ``actor_rollout_ref.rollout.dtype`` (besides null)."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and the fix."""


FREE_FORM: tuple[str, ...] = (
    "actor_rollout_ref.rollout.engine_kwargs.", "actor_rollout_ref.rollout.agent.loops.",
    "custom_reward_function.reward_kwargs.", "reward.answer_format.",
)
"""Sections whose keys are the user's (engine arguments, per-loop settings, reward kwargs, data sources);
they are checked where they are used, against the engine or loop they configure."""


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    keys = []
    for k in node.keys():
        path = f"{prefix}{k}"
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            keys.append(path)
            keys.extend(_leaf_keys(child, path + "."))
        else:
            keys.append(path)
    return keys


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested mapping (lists stay whole), so that two layers, or two
    overrides, setting different keys of one section both survive."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _check_key(key: str, valid: list[str]) -> None:
    if key in valid or (key + ".").startswith(FREE_FORM):
        return
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:
        # Match on the last component too: "rollout.temprature" -> "...rollout.temperature".
        tail = key.rsplit(".", 1)[-1]
        tails = {v.rsplit(".", 1)[-1]: v for v in valid}
        near = difflib.get_close_matches(tail, list(tails), n=1)
        close = [tails[near[0]]] if near else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config key {key!r}{hint} (see `agentloop train --show-config` for all keys)")


def _notice(message: str) -> None:
    print(f"agentloop: {message}", file=sys.stderr)


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None,
                notice: Callable[[str], None] = _notice) -> Any:
    """Build the config from defaults, an optional YAML file, then ``key=value`` overrides.

    verl's spellings are accepted in both (``actor_rollout_ref.model.path``,
    ``trainer.total_training_steps``...; see :mod:`agentloop_trainer.verl_compat`), each with
    a one-line notice.

    Args:
        overrides: Dotted ``key=value`` strings, e.g. ``actor_rollout_ref.rollout.n=4``.
        config_file: YAML file merged over the defaults.
        notice: Receives one line per verl key that was translated or ignored.

    Returns:
        A read-only OmegaConf ``DictConfig`` typed by :class:`TrainConfig`.

    Raises:
        ConfigError: an unknown key (naming the closest valid one), a malformed override, or a
            value of the wrong type.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from agentloop_trainer.verl_compat import translate

    cfg = OmegaConf.structured(TrainConfig)
    valid = _leaf_keys(cfg)
    layers: list[dict[str, Any]] = []
    try:
        if config_file is not None:
            loaded = OmegaConf.to_container(OmegaConf.load(str(config_file)), resolve=True)
            if not isinstance(loaded, dict):
                raise ConfigError(f"{config_file} is not a YAML mapping of config sections")
            layers.append(_flatten(loaded))
        dotted: dict[str, Any] = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.total_steps=20)")
            dotted.update(_flatten(OmegaConf.to_container(OmegaConf.from_dotlist([item.lstrip("+")]), resolve=True)))
        if dotted:
            layers.append(dotted)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad config value: {exc}".strip()) from None
    merged = []
    for flat in layers:
        try:
            flat = translate(flat, set(valid), notice)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for key in flat:
            _check_key(key, valid)
        if isinstance(flat.get("trainer.resume"), bool):
            flat["trainer.resume"] = "must" if flat["trainer.resume"] else "never"
        merged.append(_nest(flat))
    try:
        cfg = OmegaConf.merge(cfg, *merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad config value: {exc}".strip()) from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _nest(flat: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return OmegaConf.create(root)


def validate(cfg: Any) -> None:
    """Range and choice checks that types cannot express.

    Raises:
        ConfigError: naming the key.
    """
    from agentloop_engines.hosting import PLACEMENT_STRATEGIES
    from agentloop_trainer.algos import ADV_ESTIMATORS, LOSS_AGG_MODES
    from agentloop_trainer.scoring import ANSWER_FORMATS

    r, a = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    checks = [
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator in ADV_ESTIMATORS, f"one of {ADV_ESTIMATORS}"),
        ("actor_rollout_ref.actor.loss_agg_mode", cfg.actor_rollout_ref.actor.loss_agg_mode in LOSS_AGG_MODES,
         f"one of {LOSS_AGG_MODES}"),
        ("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n >= 1, "at least 1 (2+ for GRPO)"),
        ("data.train_batch_size", cfg.data.train_batch_size >= 1, "at least 1"),
        ("trainer.total_steps", cfg.trainer.total_steps >= 0, ">= 0"),
        ("trainer.log_trajectories_per_step", cfg.trainer.log_trajectories_per_step >= 0, ">= 0"),
        ("trainer.fsdp_ranks", cfg.trainer.fsdp_ranks >= 1, "at least 1"),
        ("trainer.device", cfg.trainer.device in ("cpu", "cuda"), "cpu or cuda"),
        ("trainer.launcher", cfg.trainer.launcher in ("spawn", "ray"), "spawn or ray"),
        ("trainer.resume", cfg.trainer.resume in ("never", "auto", "must"), "never, auto or must"),
        ("actor_rollout_ref.rollout.backend", cfg.actor_rollout_ref.rollout.backend in ("inprocess", "ray"),
         "inprocess or ray"),
        ("actor_rollout_ref.rollout.num_replicas", cfg.actor_rollout_ref.rollout.num_replicas >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.num_replicas",
         cfg.actor_rollout_ref.rollout.num_replicas == 1 or uses_ray(cfg),
         "1 with the inprocess backend (set actor_rollout_ref.rollout.backend=ray or ray.address for more)"),
        ("ray.placement_strategy", cfg.ray.placement_strategy in PLACEMENT_STRATEGIES,
         f"one of {', '.join(PLACEMENT_STRATEGIES)}"),
        ("ray.worker_placement", cfg.ray.worker_placement in ("spread", "default"), "spread or default"),
        ("actor_rollout_ref.rollout.name", r.name in ENGINE_NAMES, f"one of {ENGINE_NAMES}"),
        ("actor_rollout_ref.rollout.dtype", r.dtype is None or r.dtype in ROLLOUT_DTYPES,
         f"null (float32) or one of {ROLLOUT_DTYPES}"),
        ("actor_rollout_ref.rollout.dtype", not (r.dtype == "auto" and r.name == "hf"),
         "float32, bfloat16, float16 or null with rollout.name=hf (auto is vLLM's and SGLang's own choice)"),
        ("actor_rollout_ref.rollout.server_urls", not r.server_urls or not uses_ray(cfg),
         "unset with the ray backend (remote servers are routed from the trainer process)"),
        ("actor_rollout_ref.rollout.multi_turn.enable", r.multi_turn.enable,
         "true (agentloop's loops are multi-turn; a loop that stops after one turn is still one)"),
        ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
         r.multi_turn.tool_response_truncate_side in ("left", "right", "middle"), "left, right or middle"),
        ("actor_rollout_ref.rollout.sanity_check", r.sanity_check in ("strict", "ignore_strippable", "disable"),
         "strict, ignore_strippable or disable"),
        ("actor_rollout_ref.rollout.val_kwargs.n", r.val_kwargs.n >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.agent.turns_per_loop_iteration",
         r.agent.turns_per_loop_iteration is None or r.agent.turns_per_loop_iteration >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size",
         a.ppo_mini_batch_size is None or 1 <= a.ppo_mini_batch_size <= cfg.data.train_batch_size,
         "null or between 1 and data.train_batch_size (it counts prompts, as in verl)"),
        ("reward.source", cfg.reward.source in REWARD_SOURCES, f"one of {REWARD_SOURCES}"),
        ("reward.answer_format", all(v in ANSWER_FORMATS for v in cfg.reward.answer_format.values()),
         f"a mapping of data_source (or default) to one of {ANSWER_FORMATS}, e.g. reward.answer_format.gsm8k=flexible"),
        ("model.dtype", cfg.model.dtype in TRAIN_DTYPES,
         f"one of {TRAIN_DTYPES} (float16 needs loss scaling, which agentloop does not do: use bfloat16)"),
        ("model.lora_rank", cfg.model.lora_rank >= 0, ">= 0 (0: train every weight)"),
        ("trainer.hf_max_shard_megabytes", cfg.trainer.hf_max_shard_megabytes >= 1, "at least 1"),
        ("model.lora_alpha", cfg.model.lora_alpha > 0, "> 0"),
        ("sft.batch_size", cfg.sft.batch_size >= 1, "at least 1"),
        ("sft.micro_batch_size", cfg.sft.micro_batch_size is None or 1 <= cfg.sft.micro_batch_size <= cfg.sft.batch_size,
         "null or between 1 and sft.batch_size"),
        ("sft.epochs", cfg.sft.epochs >= 1, "at least 1"),
        ("sft.total_steps", cfg.sft.total_steps is None or cfg.sft.total_steps >= 1, "null or at least 1"),
        ("sft.max_length", cfg.sft.max_length >= 2, "at least 2"),
        ("sft.resume", cfg.sft.resume in ("never", "auto", "must"), "never, auto or must"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
         a.ppo_micro_batch_size_per_gpu is None or a.ppo_micro_batch_size_per_gpu >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
         a.log_prob_micro_batch_size_per_gpu is None or a.log_prob_micro_batch_size_per_gpu >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu >= 2, "at least 2"),
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", r.update_weights_bucket_megabytes > 0,
         "> 0"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {key} must be {expected}")
    _validate_mode(cfg)
    custom_chat_template(cfg)  # an unknown name or a missing file fails here, before anything loads


def custom_chat_template(cfg: Any) -> str | None:
    """The Jinja text ``model.custom_chat_template`` names, or None when it is unset.

    Raises:
        ConfigError: an unknown name or a missing file, listing the built-in names.
    """
    from agentloop_core.tokenization import resolve_chat_template

    value = cfg.model.custom_chat_template
    if value is None or value == "":
        return None
    try:
        return resolve_chat_template(str(value))
    except ValueError as exc:
        raise ConfigError(f"config model.custom_chat_template: {exc}") from exc


TRAINER_MODES = ("sync", "one_step_off", "async")
"""Values of ``trainer.mode``."""

ASYNC_ENGINE_NAMES = ("hf", "vllm")
"""In-process engines the asynchronous modes support (their ``abort`` returns the partial tokens)."""


def _validate_mode(cfg: Any) -> None:
    """``trainer.mode`` and ``trainer.max_staleness``, and what the async modes support so far."""
    tc, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    if tc.mode not in TRAINER_MODES:
        raise ConfigError(f"config trainer.mode must be one of {TRAINER_MODES}, got {tc.mode!r}")
    fixed = {"sync": 0, "one_step_off": 1}
    if tc.mode in fixed and tc.max_staleness not in (None, fixed[tc.mode]):
        raise ConfigError(f"config trainer.max_staleness is {fixed[tc.mode]} in trainer.mode={tc.mode}, got "
                          f"{tc.max_staleness}; leave it unset or use trainer.mode=async for another bound")
    if tc.max_staleness is not None and tc.max_staleness < 0:
        raise ConfigError(f"config trainer.max_staleness must be >= 0 (policy versions), got {tc.max_staleness}")
    if tc.mode == "sync":
        return
    # Partial rollout needs an engine whose abort returns the tokens generated so far (with
    # their log-probs); verified for hf and vllm in process, for our HTTP engine server in front
    # of either (rollout.server_urls), and for Ray replicas (the wrapper then lives in the shared
    # client actor every rollout worker calls through). Under FSDP the driver runs on rank 0,
    # which hosts the engine; the other ranks follow its updates and weight pushes. SGLang's
    # check is the gpu-marked test_real_sglang_partial_rollout_resumes_across_a_weight_update
    # (agentloop-engines): lift its refusal here once that passes on a GPU.
    unsupported = [
        ("actor_rollout_ref.rollout.name", bool(r.server_urls) or r.name in ASYNC_ENGINE_NAMES,
         f"one of {ASYNC_ENGINE_NAMES} (sglang's abort is not yet verified to return the partial tokens "
         "partial rollout resumes from)"),
    ]
    for key, ok, expected in unsupported:
        if not ok:
            raise ConfigError(f"config {key} must be {expected} with trainer.mode={tc.mode}; "
                              "or use trainer.mode=sync for this setup")


def max_staleness(cfg: Any) -> int:
    """The run's staleness bound in policy versions (``trainer.max_staleness`` or its mode's default)."""
    tc = cfg.trainer
    if tc.max_staleness is not None:
        return int(tc.max_staleness)
    return 0 if tc.mode == "sync" else 1


def offload_enabled(cfg: Any) -> bool:
    """Whether the policy is offloaded: any of the actor's ``fsdp_config`` switches."""
    f = cfg.actor_rollout_ref.actor.fsdp_config
    return bool(f.param_offload or f.optimizer_offload or f.offload_policy)


def reference_offloaded(cfg: Any) -> bool:
    """Whether a separate reference policy is loaded, and offloaded (``ref.fsdp_config.param_offload``
    or the actor's offload): KL on, no LoRA."""
    arr = cfg.actor_rollout_ref
    needed = arr.actor.use_kl_loss and cfg.model.lora_rank == 0
    return bool(needed and (arr.ref.fsdp_config.param_offload or offload_enabled(cfg)))


def uses_ray(cfg: Any) -> bool:
    """Whether the rollout runs on Ray: ``rollout.backend=ray`` or a ``ray.address`` to join."""
    return cfg.actor_rollout_ref.rollout.backend == "ray" or cfg.ray.address is not None


def to_yaml(cfg: Any) -> str:
    """The config as YAML (for ``--show-config`` and the run folder)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg)
