"""What a run shows its user: metrics (JSONL, MLflow) and the reward curve
(:mod:`~agentloop_trainer.view.metrics`), and ``agentloop view``'s trajectory page
(:mod:`~agentloop_trainer.view.viewer`).
"""

from agentloop_trainer.view.metrics import MetricsLogger, idle_fraction, plot_reward_curve
from agentloop_trainer.view.viewer import (
    TRAJECTORY_DIR,
    group_trajectories,
    render_html,
    sample_rows,
    step_trajectory_path,
    step_trajectory_records,
    summarize,
    trajectory_records,
    verdict,
    write_jsonl,
    write_step_trajectories,
    write_view,
)

__all__ = [
    "MetricsLogger",
    "TRAJECTORY_DIR",
    "group_trajectories",
    "idle_fraction",
    "plot_reward_curve",
    "render_html",
    "sample_rows",
    "step_trajectory_path",
    "step_trajectory_records",
    "summarize",
    "trajectory_records",
    "verdict",
    "write_jsonl",
    "write_step_trajectories",
    "write_view",
]
