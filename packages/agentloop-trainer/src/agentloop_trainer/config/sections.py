"""The training config: OmegaConf structured defaults with verl-familiar names.

``agentloop train key=value ...`` overrides any leaf. An unknown or mistyped key is an error
that names the key and the closest valid one, never a silently ignored setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop_core.protocol import DEFAULT_RESPONSE_LENGTH
from agentloop_trainer.config.actor_rollout_ref import ActorRolloutRefSection
from agentloop_trainer.config.critic import CriticSection
from agentloop_trainer.config.dapo import FilterGroupsSection, RewardModelSection
from agentloop_trainer.config.distill import DistillationSection


@dataclass
class DataSection:
    """Datasets (verl: ``data``)."""

    train_files: Any = None
    """Parquet file (or list of files) of training rows; None: the built-in calculator task."""
    val_files: Any = None
    """Parquet file (or list of files) of held-out rows; None: the built-in calculator task.
    Each ``data_source`` among the rows is one validation set, scored by its own scorer and
    reported on its own (``val/<data_source>/pass@k``, ``avg@k``, ``maj@k`` and their ``/se``)."""
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
    max_response_length: int = DEFAULT_RESPONSE_LENGTH
    """Token budget of a trajectory's response (generated, tool and user tokens) and the padded
    response width: the loops' ``response_length`` (verl: ``rollout.response_length``)."""
    shuffle: bool = True
    """Shuffle training rows each epoch."""
    image_key: str = "images"
    """The column holding each row's images (verl's multimodal rows: encoded bytes or paths, as
    ``{"bytes": ..., "path": ...}`` cells); each ``<image>`` marker in the prompt's text takes
    the next one. Rows may also hold image content parts in the prompt itself."""
    return_multi_modal_inputs: bool = True
    """verl's key, accepted for its configs: the rollout's processed images (pixel values and
    grids, computed once per image) always travel with the batch to the update."""


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
    cpu_matmul: str = "onednn"
    """Who multiplies the policy's float32 linear layers on the CPU (forward and backward):
    ``onednn`` (``agentloop_trainer.policy.onednn_linear``; over twice MKL's speed on AMD CPUs,
    gradients equal to ~1e-6 relative) or ``torch`` (torch's own, MKL's sgemm in the CPU
    wheels). Other devices and dtypes always use torch's own."""
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
class RolloutCorrectionSection:
    """Importance weights and rejection for the engine-vs-trainer log-prob gap (verl:
    ``algorithm.rollout_correction``; see :mod:`agentloop_trainer.update.rollout_correction`).
    ``actor.tis_cap`` is the same correction as ``rollout_is=token`` with a cap: set one of the
    two (``actor.tis_cap=null`` with ``rollout_is``)."""

    rollout_is: str | None = None
    """null (no weights) | token (each token by its ratio old/rollout) | sequence (every token of
    a sequence by the product of its ratios; a trajectory split into segments is one sequence)."""
    rollout_is_threshold: Any = 2.0
    """A cap on the weight (truncated IS), or ``"lower_upper"`` (e.g. ``"0.5_2.0"``: IcePop, a
    weight outside the bounds becomes 0). Write both bounds with a decimal point: YAML reads
    ``0.5_2`` as the number 0.52."""
    rollout_rs: str | None = None
    """null | rejection options, comma-separated, all must pass: token_k1, token_k2, token_k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1: geometric mean), seq_max_k2/k3. A
    rejected token or sequence leaves the loss and its normaliser."""
    rollout_rs_threshold: Any = None
    """Bounds of ``rollout_rs``, one for all options or one per option (comma-separated): k1 takes
    ratio bounds ``"lower_upper"`` on pi_rollout/pi_old (``u`` alone: ``1/u`` to ``u``), k2 and k3
    an upper bound on the divergence."""


@dataclass
class AlgorithmSection:
    """Advantage estimation and rollout correction (verl: ``algorithm``)."""

    adv_estimator: str = "grpo"
    """A name in the estimator table (``update.advantages.ADVANTAGE_ESTIMATORS``; add one with
    ``register_advantage_estimator``): grpo (mean/std per group) | dr_grpo (mean only) | rloo (each
    reward minus the mean of the group's other rewards; needs rollout.n >= 2) | gae (PPO: GAE over
    the model's tokens with a value model trained beside the policy; needs critic.optim.lr, see
    the ``critic`` section and docs/ppo.md)."""
    turn_credit: str = "trajectory"
    """How a multi-turn trajectory's credit is split over its turns (a turn: one run of model
    tokens): trajectory (one advantage per trajectory, on every token) | discounted (turn t's
    return G_t = r_t + turn_gamma * G_{t+1} minus the mean episode return of the group's other
    trajectories) | turn_group (MT-GRPO: minus the mean return at turn t of the other
    trajectories that reached it) | step_group (GiGPO: the trajectory advantage plus
    step_group_weight x G_t minus the mean return of the other trajectories' turns that saw the
    identical token prefix). Per-turn rewards come from the loop (``extra_fields["turn_rewards"]``:
    env step rewards, tool rewards, interaction turn scores) or the reward function; the rest of
    the reward goes to the last turn. Baselines are leave-one-out; adv_estimator=grpo divides by
    the std. Needs rollout.n >= 2 unless trajectory. See docs/beyond-grpo.md."""
    turn_gamma: float = 1.0
    """Discount from one turn to the next in the per-turn returns (0 to 1; 1: every turn's return
    is the reward still to come)."""
    step_group_weight: float = 1.0
    """w in step_group's A = A_trajectory + w x A_step (GiGPO uses 1); >= 0."""
    gamma: float = 1.0
    """GAE's discount per model token (``adv_estimator=gae``; 0 to 1; verl's default 1)."""
    lam: float = 1.0
    """GAE's lambda (``adv_estimator=gae``; 0 to 1; 1: Monte-Carlo returns minus values)."""
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)
    """Dynamic sampling (DAPO): drop groups whose samples all score the same."""
    rollout_correction: RolloutCorrectionSection = field(default_factory=RolloutCorrectionSection)
    """Importance weights / rejection for the rollout-vs-trainer mismatch (beside ``actor.tis_cap``)."""


@dataclass
class CustomRewardFunctionSection:
    """A reward function from a Python file (verl: ``custom_reward_function``)."""

    path: str | None = None
    """Python file defining the function; null: the built-in scorer of each row's ``data_source``."""
    name: str = "compute_score"
    """Function name; signature ``(data_source, solution_str, ground_truth, extra_info)``, sync
    or async, returning a float or a dict with ``score`` (other numbers become metrics); or
    per-turn scores for ``algorithm.turn_credit``: a list (one per turn; the score is their sum)
    or a dict with ``turn_rewards`` and optionally ``score``."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the function."""


@dataclass
class RubricCriterionSection:
    """One ``reward.judge.rubric`` criterion (:mod:`agentloop_trainer.reward.rubric`)."""

    name: str = ""
    """The key the judge scores it under in its JSON reply, and the metric ``judge/<name>``: an
    identifier, not one of the cost metrics' names (calls, failures...)."""
    description: str = ""
    """What the judge reads about it."""
    weight: float = 1.0
    """Its share of the reward (> 0), relative to the other criteria's weights."""


@dataclass
class JudgeSection:
    """A model-judged reward (``reward.judge``): a model reads each finished trajectory through a
    prompt template and its reply's score becomes (part of) the reward; see
    :mod:`agentloop_trainer.reward.judge`."""

    enable: bool = False
    """Score every trajectory with the judge."""
    url: str | None = None
    """The judge: an OpenAI-compatible base URL (``http://127.0.0.1:8001/v1``, e.g. an
    ``agentloop serve``), or ``policy``: the policy's own rollout engine (in-process backends)."""
    model: str | None = None
    """The ``model`` of each chat request; null: none sent (the server's default model)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the judge's API key (never the key itself)."""
    prompt: str | None = None
    """The judge's user message: a template with ``{question}``, ``{prompt}``, ``{response}``,
    ``{ground_truth}``, ``{data_source}`` (literal braces doubled), or the path of a file holding
    one; null: a built-in 0-10 grading prompt that asks for ``Score: N``. With ``mode=group``,
    ``{responses}`` (the group's answers, numbered) and ``{n}`` stand for ``{response}``; with a
    ``rubric``, ``{criteria}`` must show the criteria. null then: a built-in prompt for that mode."""
    parser: str = "regex"
    """regex: the last match of ``pattern``'s one group | json: the value at ``json_path`` of the
    last JSON object in the reply. For one score per trajectory only: group and rubric replies
    are always JSON (see ``mode`` and ``rubric``)."""
    pattern: str = r"[Ss]core\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    """The score regex (one capturing group), for ``parser=regex``."""
    json_path: str = "score"
    """Dotted key of the score in the reply's JSON object, for ``parser=json``."""
    score_range: list[float] | None = field(default_factory=lambda: [0.0, 10.0])
    """``[low, high]``: the parsed score mapped linearly onto [0, 1] (a score outside is a failed
    judgement); null: the raw score."""
    temperature: float = 0.0
    """Judge sampling temperature (0: greedy, the same verdict for the same trajectory)."""
    max_tokens: int = 64
    """Most tokens the judge may reply with."""
    timeout_s: float = 60.0
    """Seconds one judge call may take."""
    retries: int = 2
    """Further attempts after a failed call (timeout, HTTP error, no parseable score)."""
    max_concurrency: int = 8
    """Judge calls in flight at once (per rollout worker); trajectories are judged as they finish."""
    combine: str = "replace"
    """replace: the reward is ``weight`` x the judge's score | add: the rule or custom reward
    (``reward.source``) plus ``weight`` x the judge's score."""
    weight: float = 1.0
    """Factor on the judge's score."""
    failure_score: float | None = None
    """null: a judgement that fails after the retries fails its sample, with the reason; a
    number: that judge score instead (counted in ``judge/failures`` all the same)."""
    max_response_bytes: int = 4 * 1024 * 1024
    """Most bytes read from the judge server per answer (a judge's reply is a few KB): a body
    over it, or a compressed one, fails that judgement naming this key before it is parsed."""
    mode: str = "single"
    """single: each trajectory judged on its own as it finishes | group: the trajectories of a
    GRPO group (``rollout.n`` samples of a prompt) judged together in one request once the group
    is rolled out, each scored relative to the others (ART's RULER); needs ``rollout.n >= 2``,
    ``trainer.mode=sync``, and a ``max_tokens`` that fits a score per answer. Group replies are
    JSON: ``{"scores": [s1, s2, ...]}``."""
    rubric: list[RubricCriterionSection] | None = None
    """Criteria the judge scores separately, each ``{name, description, weight}``; the reward is
    their weighted mean, each score mapped by ``score_range`` first, and each criterion's score
    is the metric ``judge/<name>``. The reply is JSON: ``{"scores": {"<name>": N, ...}}`` (group
    mode: a list of those). null: one score."""


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
    judge: JudgeSection = field(default_factory=JudgeSection)
    """A model-judged reward (off by default)."""
    timeout_s: float | None = 300.0
    """The most seconds one call of the reward function (custom or built-in) may take; past it
    the sample fails with ``RewardTimeoutError`` (counted in ``rollout/num_failed``) and the batch
    goes on. A sync function is abandoned on its own daemon thread. null: no limit."""


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


@dataclass
class TrainerSection:
    """Run control (verl: ``trainer``)."""

    total_steps: int = 30
    """GRPO steps (verl: ``total_training_steps``; 30 keep the default job short on 2 CPU cores;
    the H200 runs in the README used 50)."""
    seed: int = 0
    """Seed of data order, sampling and the engine."""
    project_name: str = "agentloop"
    """Project: the MLflow experiment and the W&B project."""
    experiment_name: str | None = None
    """Run name: outputs go to ``<output_dir>/<experiment_name>``; None: a timestamp. Also the
    MLflow and W&B run name."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Where metrics go (verl's key): any of console, jsonl, mlflow, wandb, tensorboard, as a
    list (``[console,wandb]``) or a comma string (``console,wandb``). ``metrics.jsonl`` is always
    written, listed or not (the viewer and scripts read it)."""
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
    """Evaluate every validation set every this many steps (0 or -1: only before and after):
    ``eval/accuracy`` plus ``val/<data_source>/{pass@k,avg@k,maj@k}`` with standard errors
    (``/se``), logged to every logger in ``trainer.logger``."""
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
    """MLflow's tracking URI (e.g. sqlite:///mlflow.db); setting it turns on the mlflow logger.
    null with ``mlflow`` in ``trainer.logger``: ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<run>/mlflow.db``."""
    wandb_mode: str | None = None
    """online, offline or disabled; null: ``$WANDB_MODE``, else online when ``$WANDB_API_KEY`` is
    set and offline (files only, ``wandb sync`` uploads them) when not."""
    wandb_dir: str | None = None
    """Where W&B writes its ``wandb/`` folder; null: the run folder."""
    tensorboard_dir: str | None = None
    """TensorBoard event files' folder; null: ``<run>/tensorboard``."""
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
    critic_warmup: int = 0
    """With ``algorithm.adv_estimator=gae``: the first this many steps train only the critic
    (the policy stays as it is while the value model learns the reward's scale)."""
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
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ray: RaySection = field(default_factory=RaySection)
    distillation: DistillationSection = field(default_factory=DistillationSection)
    critic: CriticSection = field(default_factory=CriticSection)
