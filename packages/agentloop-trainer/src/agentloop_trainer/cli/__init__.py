"""The ``agentloop`` command line (:func:`main`; :mod:`~agentloop_trainer.cli.main` holds the
commands, :mod:`~agentloop_trainer.cli.evaluate` ``agentloop eval`` and ``agentloop rollout``).
"""

from agentloop_trainer.cli.evaluate import evaluate_checkpoint, write_rollouts
from agentloop_trainer.cli.main import build_parser, main, run_dir_of, run_train

__all__ = [
    "build_parser",
    "evaluate_checkpoint",
    "main",
    "run_dir_of",
    "run_train",
    "write_rollouts",
]
