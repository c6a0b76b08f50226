"""verl's own GSM8K tool-agent example runs as verl ships it: the rows its preprocessing script
writes, its tool config naming ``verl.tools.gsm8k_tool.Gsm8kTool``, its Hydra config file and
every override of its MLflow-traced run script, with only what a CPU run must change. And
verl's tool classes, trace keys and Hydra options each read as ours, or fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentloop_trainer.cli import main
from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.data import write_parquet_rows

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as it is.
VERL_TOOL_CONFIG = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml, as it is.
VERL_GRPO_CONFIG = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""

PROBLEMS = [
    ("A baker makes 12 rolls in the morning and 9 in the afternoon. How many rolls does she make?", "21"),
    ("Mia has 40 stickers and gives 15 to her brother. How many stickers does she keep?", "25"),
    ("A bus carries 7 rows of 4 seats. How many seats are on the bus?", "28"),
    ("Leo saves 6 dollars a week for 5 weeks. How much does he save?", "30"),
    ("A farmer splits 36 eggs evenly into 4 baskets. How many eggs are in each basket?", "9"),
    ("There are 18 birds on a wire and 7 fly away. How many birds are left?", "11"),
    ("A shop sells 3 boxes of 10 pencils each. How many pencils is that?", "30"),
    ("Nina runs 2 miles a day for 8 days. How many miles does she run?", "16"),
]


def verl_row(question: str, solution: str, split: str, idx: int) -> dict:
    """One row in the layout of verl's examples/data_preprocessing/gsm8k_tool_agent_loop.py."""
    instruction = "Let's think step by step and output the final answer after `####`."
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [
            {"role": "system", "content": "You are a math expert. Solve the question step by step, call the "
                                          "`calc_gsm8k_reward` tool to check your answer, and put the final answer "
                                          "in the format `#### <answer>`."},
            {"role": "user", "content": f"{question} {instruction}"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": idx,
            "answer": f"#### {solution}",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    }


def verl_example(tmp_path: Path, model_path: Path) -> tuple[Path, list[str]]:
    """verl's example files written into ``tmp_path``; returns its config folder and the run
    script's overrides, each as verl's script has it unless a CPU run must change it."""
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    rows = [verl_row(q, a, "train" if i < 6 else "test", i) for i, (q, a) in enumerate(PROBLEMS)]
    write_parquet_rows(rows[:6], data / "train.parquet")
    write_parquet_rows(rows[6:], data / "test.parquet")
    config = tmp_path / "examples" / "sglang_multiturn" / "config"
    (config / "tool_config").mkdir(parents=True)
    (config / "tool_config" / "gsm8k_tool_config.yaml").write_text(VERL_TOOL_CONFIG)
    (config / "gsm8k_multiturn_grpo.yaml").write_text(VERL_GRPO_CONFIG)
    overrides = [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=1",
        "data.max_prompt_length=1024",
        "data.max_response_length=48",  # CPU: 512 in verl's script
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
        "data.return_raw_chat=True",
        f"actor_rollout_ref.model.path={model_path}",  # CPU: Qwen/Qwen3-0.6B
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=hf",  # CPU: vllm
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.75",
        "actor_rollout_ref.rollout.n=2",  # CPU: 8
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "actor_rollout_ref.rollout.trace.backend=mlflow",
        "actor_rollout_ref.rollout.trace.token2text=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        """trainer.logger=["console","mlflow"]""",
        "trainer.project_name=gsm8k_tool-agent",
        "trainer.experiment_name=qwen3-0.6b_function_rm-gsm8k-sgl-tool-agent-verify-n16",
        "trainer.n_gpus_per_node=0",  # CPU: 1
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=20",
        "trainer.total_training_steps=2",
        f"data.train_files={data / 'train.parquet'}",  # verl's script: its own data folder
        f"data.val_files={data / 'test.parquet'}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config / 'tool_config' / 'gsm8k_tool_config.yaml'}",
        "trainer.total_epochs=15",
    ]
    return config, overrides


def test_verl_example_loads_with_one_line_notices(tmp_path, random_model_path):
    config, overrides = verl_example(tmp_path, random_model_path)
    notices: list[str] = []
    cfg = load_config(overrides, config / "gsm8k_multiturn_grpo.yaml", notice=notices.append)
    trace = cfg.actor_rollout_ref.rollout.trace
    assert (trace.backend, trace.token2text) == ("mlflow", True)
    assert cfg.model.path == str(random_model_path)
    assert cfg.trainer.total_steps == 2
    assert cfg.data.train_batch_size == 1  # the override wins over the file's 256
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 5  # from the file
    text = "\n".join(notices)
    assert "defaults entry ppo_trainer (verl's base config) read as agentloop's defaults" in text
    assert "section hydra ignored" in text
    assert "verl tool verl.tools.gsm8k_tool.Gsm8kTool read as agentloop_tools.builtin.gsm8k.Gsm8kTool" in text
    assert all("\n" not in line for line in notices)
    assert len(notices) == len(set(notices)), "a notice printed twice"


@pytest.mark.slow
def test_verl_example_trains_two_steps_and_traces_to_mlflow(tmp_path, random_model_path, monkeypatch, capsys):
    """`agentloop train --config-path=... --config-name=gsm8k_multiturn_grpo <verl's overrides>`
    runs 2 steps, and the rollouts are MLflow traces (with their text: token2text) in the store
    of $MLFLOW_TRACKING_URI, where verl's run script sends them. A failure here: run the same
    command by hand and read the agentloop: notice lines and the first error."""
    mlflow = pytest.importorskip("mlflow", reason="needs mlflow: pip install 'agentloop-trainer[mlflow]'")
    from mlflow import MlflowClient

    config, overrides = verl_example(tmp_path, random_model_path)
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(tmp_path)  # verl's runs write under the working folder too
    assert main(["train", f"--config-path={config}", "--config-name=gsm8k_multiturn_grpo", *overrides]) == 0

    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agentloop: ")]
    assert len(notices) >= 20, notices
    assert len(notices) == len(set(notices)), notices
    run = tmp_path / "outputs" / "qwen3-0.6b_function_rm-gsm8k-sgl-tool-agent-verify-n16"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "actor/pg_loss" in s] == [1, 2]
    experiment = MlflowClient(db).get_experiment_by_name("gsm8k_tool-agent")
    assert experiment is not None, "no MLflow experiment named trainer.project_name"
    mlflow.set_tracking_uri(db)
    traces = mlflow.search_traces(locations=[experiment.experiment_id], max_results=200, return_type="list")
    # 2 steps of 1 prompt x 2 samples, and the held-out rows before and after.
    assert len(traces) >= 4
    roots = [s for t in traces for s in t.data.spans if s.name == "agent_loop"]
    assert roots
    assert all("calc_gsm8k_reward" in s.attributes["prompt_text"] for s in roots)
    train = [s for s in roots if not s.attributes.get("validate")]
    assert len(train) == 4, "2 steps x 1 prompt x 2 samples"
    assert len({s.attributes["step"] for s in train}) == 2


@pytest.mark.parametrize(("verl_class", "ours"), [
    ("verl.tools.gsm8k_tool.Gsm8kTool", "agentloop_tools.builtin.gsm8k.Gsm8kTool"),
    ("verl.tools.image_zoom_in_tool.ImageZoomInTool", "agentloop_tools.builtin.image_zoom.ImageZoomInTool"),
    ("verl.tools.sandbox_fusion_tools.SandboxFusionTool", "agentloop_tools.builtin.sandbox.PythonSandboxTool"),
])
def test_a_verl_tool_class_reads_as_ours_with_a_notice(verl_class, ours):
    from agentloop_core.imports import import_object
    from agentloop_tools.verl_tools import translate_tool_entry

    entry, notices = translate_tool_entry({"class_name": verl_class, "config": {"type": "native"}}, "t.yaml: tools[0]")
    assert entry["class_name"] == ours
    assert import_object(ours) is not None
    (notice,) = notices
    assert verl_class in notice
    assert "\n" not in notice


def test_sandbox_fusion_config_is_mapped_key_by_key():
    from agentloop_tools.verl_tools import translate_tool_entry

    entry, notices = translate_tool_entry(
        {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
         "config": {"sandbox_fusion_url": "https://example.invalid/run_code", "default_timeout": 30,
                    "memory_limit_mb": 1024, "num_workers": 10, "default_language": "python"}}, "t.yaml: tools[0]")
    assert entry["config"] == {"timeout_s": 30, "memory_mb": 1024, "type": "native"}
    assert any("default_timeout read as timeout_s" in n for n in notices)
    assert any("sandbox_fusion_url ignored" in n for n in notices)
    with pytest.raises(ValueError, match=r"default_language='go' is not supported: the sandbox runs Python only"):
        translate_tool_entry({"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                              "config": {"default_language": "go"}}, "t.yaml: tools[0]")


@pytest.mark.parametrize("verl_class", ["verl.tools.mcp_search_tool.MCPSearchTool",
                                        "verl.tools.mcp_base_tool.MCPBaseTool"])
def test_verl_mcp_tools_become_mcp_entries(verl_class):
    from agentloop_tools.verl_tools import translate_tool_entry

    mcp = {"mcp_servers_config_path": "./mcp_server.json", "tool_selected_list": ["tavily_search_tool"]}
    entry, notices = translate_tool_entry(
        {"class_name": verl_class, "config": {"rate_limit": 120, "timeout": 120, "use_mcp": True}, "mcp": mcp},
        "t.yaml: tools[0]")
    assert entry == {"config": {"timeout_s": 120, "type": "mcp"}, "mcp": mcp}
    assert "read as an MCP entry" in notices[0]
    assert all("\n" not in n for n in notices)


@pytest.mark.parametrize(("verl_class", "use"), [
    ("verl.tools.search_tool.SearchTool", "MCP server"),
    ("verl.tools.geo3k_tool.Geo3kTool", "BaseTool subclass"),
    ("verl.tools.some_new_tool.NewTool", "verl.tools.gsm8k_tool.Gsm8kTool"),
])
def test_a_verl_tool_without_a_counterpart_is_one_line_naming_what_to_use(tmp_path, verl_class, use, capsys):
    tools = tmp_path / "tools.yaml"
    tools.write_text(f"tools:\n  - class_name: {verl_class}\n    config: {{}}\n")
    assert main(["train", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", "--show-config"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "multi_turn.tool_config_path" in line
    assert verl_class in line
    assert use in line
    assert "No module named" not in line


def test_trace_backends_we_do_not_have_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"trace\.backend must be null, mlflow or jsonl .*got 'weave'"):
        load_config(["actor_rollout_ref.rollout.trace.backend=weave"])
    notices: list[str] = []
    cfg = load_config(["actor_rollout_ref.rollout.trace.backend=jsonl",
                       "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=2",
                       "actor_rollout_ref.rollout.trace.experiment_name=x"], notice=notices.append)
    assert cfg.actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker == 2
    assert notices == ["verl key actor_rollout_ref.rollout.trace.experiment_name ignored (each trace is tagged "
                       "with its step, sample_index and rollout_n, in the experiment trace.project_name)"]


def test_max_samples_per_step_keeps_whole_groups(tmp_path):
    """At most N prompts per step are traced, each with all its samples, and spans nested in an
    untraced trajectory are dropped with it."""
    from agentloop_core.tracing import make_tracer, trace_context
    from agentloop_trainer.rollout.tracing import SampledTracer

    tracer = SampledTracer(make_tracer({"backend": "jsonl", "path": str(tmp_path / "t.jsonl")}), max_prompts=2, n=3)
    for step in (1, 2):
        for index in range(12):  # 4 prompts x 3 samples
            with trace_context(step=step, sample_index=index, validate=False), tracer.span("agent_loop"), \
                    tracer.span("generate"):
                pass
    tracer.close()
    spans = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    roots = [(s["step"], s["sample_index"]) for s in spans if s["name"] == "agent_loop"]
    assert roots == [(step, i) for step in (1, 2) for i in range(6)]
    assert sum(s["name"] == "generate" for s in spans) == 12


@pytest.mark.parametrize(("argv", "message"), [
    (["--config-path=/nowhere", "--config-name=gsm8k_multiturn_grpo"], "/nowhere/gsm8k_multiturn_grpo.yaml' does not exist"),
    (["--config-name=ppo_megatron_trainer"], "agentloop trains with FSDP2, not Megatron"),
    (["--config=x.yaml", "--config-name=y"], "give either --config FILE or --config-path/--config-name"),
    (["actor_rollout_ref.rollout.trace.token2text=maybe"], "trace.token2text"),
    (["actor_rollout_ref.rollout.trace.bakend=mlflow"], "did you mean 'actor_rollout_ref.rollout.trace.backend'"),
    (["actor_rollout_ref.actor.entropy_coeff=0.01"], "entropy_coeff=0.01 is not supported"),
])
def test_a_bad_key_or_value_is_one_clean_line(argv, message, capsys):
    assert main(["train", *argv, "--show-config"]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert message in line
    assert "Traceback" not in err


def test_config_name_ppo_trainer_reads_our_defaults(capsys):
    assert main(["train", "--config-name=ppo_trainer", "--show-config"]) == 0
    assert "--config-name ppo_trainer (verl's base config) read as agentloop's defaults" in capsys.readouterr().err


def test_a_defaults_entry_naming_a_file_beside_it_is_merged_first(tmp_path):
    (tmp_path / "base.yaml").write_text("defaults:\n  - ppo_trainer\ndata:\n  train_batch_size: 4\n  shuffle: false\n")
    (tmp_path / "child.yaml").write_text("defaults:\n  - base\n  - _self_\ndata:\n  train_batch_size: 6\n")
    cfg = load_config([], tmp_path / "child.yaml", notice=lambda _: None)
    assert (cfg.data.train_batch_size, cfg.data.shuffle) == (6, False)
    (tmp_path / "odd.yaml").write_text("defaults:\n  - override rollout: sglang\n")
    with pytest.raises(ConfigError, match="defaults entry .* is neither verl's base config"):
        load_config([], tmp_path / "odd.yaml")
