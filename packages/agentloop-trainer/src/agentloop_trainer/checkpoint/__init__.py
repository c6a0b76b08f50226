"""Checkpoints: where to change the checkpoint format.

- :mod:`~agentloop_trainer.checkpoint.common`: what every format shares (step folders, the
  ``latest`` pointer, atomic commits, RNG and plain-type state) and the single-file format.
- :mod:`~agentloop_trainer.checkpoint.sharded`: the GRPO trainer's format (DCP shards per rank,
  resumable on any number of ranks).
- :mod:`~agentloop_trainer.checkpoint.hf_folder`: the policy as a Hugging Face folder.
- :mod:`~agentloop_trainer.checkpoint.run`: save and resume of a GRPO run (and agentloop 0.3's
  single-file checkpoints).
"""

from agentloop_trainer.checkpoint.common import (
    HF_DIR,
    LATEST,
    RESUME_MODES,
    STATE_DIR,
    CheckpointError,
    checkpoint_to_resume,
    is_sharded_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from agentloop_trainer.checkpoint.hf_folder import INDEX_NAME, WEIGHTS_NAME, final_hf_folder, write_hf_folder
from agentloop_trainer.checkpoint.run import (
    CHECKPOINTS_DIR,
    load_run_checkpoint,
    load_single_file_checkpoint,
    save_run_checkpoint,
)
from agentloop_trainer.checkpoint.sharded import (
    SHARDED_FORMAT,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointError",
    "HF_DIR",
    "INDEX_NAME",
    "LATEST",
    "RESUME_MODES",
    "SHARDED_FORMAT",
    "STATE_DIR",
    "WEIGHTS_NAME",
    "checkpoint_to_resume",
    "final_hf_folder",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_run_checkpoint",
    "load_sharded_checkpoint",
    "load_single_file_checkpoint",
    "rng_state",
    "save_checkpoint",
    "save_run_checkpoint",
    "save_sharded_checkpoint",
    "set_rng_state",
    "write_hf_folder",
]
