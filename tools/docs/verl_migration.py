"""The migration guide from verl (``docs/migrate-from-verl.md``), generated from the tables the
config loader reads (:mod:`agentloop_trainer.config.verl_compat`, with verl's tool classes from
:mod:`agentloop_tools.verl_tools`), so the page cannot say something the loader does not do.

Run ``python tools/docs/verl_migration.py`` after changing a table to rewrite the page;
``tests/docs/test_verl_migration.py`` fails while the page and the tables differ.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import config_reference  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrate-from-verl.md"
"""The generated page (committed, so the site and the repository show the same text)."""

SCRIPT = "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_tool_agent_mlflow.sh"
"""The verl run script the worked example follows."""

CONFIG_PATH = "examples/sglang_multiturn/config"
CONFIG_NAME = "gsm8k_multiturn_grpo"

EXAMPLE: list[tuple[str, Any]] = [
    ("algorithm.adv_estimator", "grpo"), ("data.train_batch_size", 1), ("data.max_prompt_length", 1024),
    ("data.max_response_length", 512), ("data.filter_overlong_prompts", False), ("data.truncation", "left"),
    ("data.return_raw_chat", True), ("actor_rollout_ref.model.path", "Qwen/Qwen3-0.6B"),
    ("actor_rollout_ref.actor.optim.lr", 1e-6), ("actor_rollout_ref.model.use_remove_padding", True),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 1), ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1),
    ("actor_rollout_ref.actor.use_kl_loss", True), ("actor_rollout_ref.actor.kl_loss_coef", 0.001),
    ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl"), ("actor_rollout_ref.actor.entropy_coeff", 0),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", True),
    ("actor_rollout_ref.actor.fsdp_config.param_offload", False),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", False),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 1),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", 1), ("actor_rollout_ref.rollout.name", "vllm"),
    ("actor_rollout_ref.rollout.mode", "async"), ("actor_rollout_ref.rollout.gpu_memory_utilization", 0.75),
    ("actor_rollout_ref.rollout.n", 8), ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1),
    ("actor_rollout_ref.ref.fsdp_config.param_offload", True), ("actor_rollout_ref.rollout.trace.backend", "mlflow"),
    ("actor_rollout_ref.rollout.trace.token2text", True), ("algorithm.use_kl_in_reward", False),
    ("trainer.critic_warmup", 0), ("trainer.logger", ["console", "mlflow"]),
    ("trainer.project_name", "gsm8k_tool-agent"), ("trainer.experiment_name", "qwen3-0.6b_gsm8k-tool-agent"),
    ("trainer.n_gpus_per_node", 1), ("trainer.nnodes", 1), ("trainer.save_freq", -1), ("trainer.test_freq", 20),
    ("trainer.total_training_steps", 2), ("data.train_files", "data/gsm8k/train.parquet"),
    ("data.val_files", "data/gsm8k/test.parquet"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path",
     "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"),
    ("trainer.total_epochs", 15),
]
"""The overrides of verl's :data:`SCRIPT`, in its order (its data paths written as
``data/gsm8k``, where verl's GSM8K preprocessing writes)."""


def _value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return config_reference.format_default(value)


def _code(items: Any) -> str:
    return ", ".join(f"`{k}`" for k in items)


def _example_rows() -> tuple[list[str], list[str]]:
    """The worked example's table rows and the agentloop command's overrides."""
    from agentloop_trainer.config import verl_compat

    valid = {e.key for s in config_reference.sections() for e in s.entries}
    rows, command = [], []
    for key, value in EXAMPLE:
        reading = verl_compat.read_key(key, value, valid)
        if reading.kind == "same":
            how = "the same key"
        elif reading.kind in ("renamed", "split"):
            how = "read as " + " and ".join(f"`{k}`" for k in reading.keys)
        elif reading.kind == "only_value":
            how = f"accepted at this value, no effect: {reading.why}"
        elif reading.kind == "ignored":
            how = f"ignored: {reading.why}"
        else:
            raise ValueError(f"the example's key {key} is unknown to agentloop; add it to verl_compat's tables")
        rows.append(f"| `{key}={_value(value)}` | {how} |")
        command += [f"{k}={_value(value)}" for k in reading.keys]
    return rows, command


def _tool_rows() -> list[str]:
    from agentloop_trainer.config import verl_compat

    rows = []
    for name, spec in verl_compat.VERL_TOOL_CLASSES.items():
        if spec.kind == "mcp":
            ours = "an MCP entry (`config.type: mcp`, its `mcp:` block as it is)"
        elif spec.ours is None:
            ours = "error"
        else:
            ours = f"`{spec.ours}`"
        keys = [f"`{k}` read as `{v}`" for k, v in spec.renamed.items()]
        keys += [f"`{k}` ignored ({why})" for k, why in spec.dropped.items()]
        keys += [f"`{k}` only `{v}` ({why})" for k, (v, why) in spec.only.items()]
        what = spec.note if spec.ours is not None or spec.kind == "mcp" else f"use instead: {spec.note}"
        rows.append(f"| `{name}` | {ours} | {what} | {'; '.join(keys) or '-'} |")
    return rows


def _trace_keys() -> list[str]:
    from agentloop_trainer.rollout.settings import TraceSection

    docs = config_reference.field_docs(TraceSection)
    return [f"- **`actor_rollout_ref.rollout.trace.{f.name}`** = `{config_reference.format_default(f.default)}`: "
            f"{config_reference._prose(docs.get(f.name, ''))}" for f in dataclasses.fields(TraceSection)]


def render() -> str:
    """The whole page as Markdown."""
    from agentloop_trainer.config import verl_compat

    rows, command = _example_rows()
    lines = [
        "# Migrate from verl",
        "",
        "<!-- Generated by tools/docs/verl_migration.py from agentloop_trainer.config.verl_compat and "
        "agentloop_tools.verl_tools; edit those and rerun it, not this page. -->",
        "",
        "`agentloop train` reads verl's configs: its keys (`actor_rollout_ref.rollout....`), its Hydra "
        "options (`--config-path`, `--config-name`), its config files with their `defaults:` list, its "
        "tool configs with verl's tool classes, and its dataset rows (`prompt`, `reward_model`, "
        "`extra_info.tools_kwargs`). A key that means the same here is read as it is; a key agentloop "
        "spells differently, ignores or honours at one value only prints one `agentloop:` line saying so; "
        "anything else is a one-line error naming the key and the fix. Everything below is generated "
        "from the tables the loader reads, so it is what the loader does.",
        "",
        "## verl's GSM8K tool-agent example, key by key",
        "",
        f"verl's `{SCRIPT}` passes these overrides (its data and tool config paths written here as the "
        "output of verl's GSM8K tool-agent preprocessing and verl's `gsm8k_tool_config.yaml`); the right "
        "column is how agentloop reads each one.",
        "",
        "| verl override | agentloop |",
        "| --- | --- |",
        *rows,
        "",
        "On a machine with a GPU these overrides run as they are, with `agentloop train` in place of "
        "`python3 -m verl.trainer.main_ppo` and the same `--config-path`/`--config-name`, on verl's "
        "rows and tool config as they are (`verl.tools.gsm8k_tool.Gsm8kTool` included). Written with "
        "agentloop's spellings and without the keys that have no effect, the same run is:",
        "",
        '<!-- snippet: skip reason="needs verl\'s example folder, its GSM8K data and a GPU" -->',
        "```bash",
        f"agentloop train --config-path={CONFIG_PATH} --config-name={CONFIG_NAME} \\",
        *[f"    {shlex.quote(item)} \\" for item in command[:-1]],
        f"    {shlex.quote(command[-1])}",
        "```",
        "",
        "Traces go where verl's script sends them: the MLflow store of `$MLFLOW_TRACKING_URI` "
        "(else `trainer.mlflow_tracking_uri`, else `<run>/mlflow.db`), in the experiment "
        "`trainer.project_name`, one trace per trajectory. `agentloop rollout` and `agentloop view` "
        "read the same runs.",
        "",
        "## Hydra options and config files",
        "",
        "`--config-path DIR --config-name NAME` (or `-cp`/`-cn`) reads `DIR/NAME.yaml` as `--config` "
        "does. Its top-level sections that configure Hydra itself are ignored: "
        + "; ".join(f"`{k}` ({why})" for k, why in verl_compat.HYDRA_SECTIONS.items())
        + ". Its `defaults:` list may name a file of the same folder (merged below it, in order, with "
        "`_self_` where it stands) or one of verl's base configs:",
        "",
        *[f"- `{name}`: " + ("read as agentloop's defaults (with a notice)" if why is None else f"an error: {why}")
          for name, why in verl_compat.VERL_BASE_CONFIGS.items()],
        "",
        "## Rollout tracing",
        "",
        "verl's `actor_rollout_ref.rollout.trace` keys are agentloop's too; a backend agentloop does not "
        "have (verl's `weave`) is an error naming the ones it has.",
        "",
        *_trace_keys(),
        "",
        "## Tool classes",
        "",
        "A tool config (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) naming one of verl's "
        "classes is read as agentloop's, with one notice per class and per `config:` key changed; a class "
        "without a counterpart is a one-line error saying what to use. The file is read when the config "
        "loads, before the run starts.",
        "",
        "| verl class | agentloop | how it differs / what to use | `config:` keys |",
        "| --- | --- | --- | --- |",
        *_tool_rows(),
        "",
        "## Renamed keys",
        "",
        "| verl key | agentloop key |",
        "| --- | --- |",
        *[f"| `{k}` | `{v}` |" for k, v in verl_compat.RENAMED.items()],
        *[f"| `{k}` | {_code(v)} |" for k, v in verl_compat.SPLIT.items()],
        "",
        "## Keys accepted at one value",
        "",
        "Any other value is an error that says why.",
        "",
        *[f"- `{k}` = {', '.join(f'`{_value(v)}`' for v in allowed)}: {why}"
          for k, (allowed, why) in verl_compat.ONLY_VALUE.items()],
        "",
        "## Keys accepted and ignored",
        "",
        "Each key below, and every key under one ending in `.`, is read and ignored with a notice "
        f"(unless it says otherwise: {verl_compat.DEFAULT_REASON}):",
        "",
        *[f"- `{k}`" + (f": {verl_compat.REASONS[k]}" if k in verl_compat.REASONS else "")
          for k in verl_compat.NO_EFFECT],
        "",
        "Every other key is agentloop's own; the config reference lists them all with their defaults.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
