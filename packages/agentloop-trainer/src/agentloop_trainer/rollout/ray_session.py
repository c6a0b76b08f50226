"""The Ray cluster of a run: joined (``ray.address``) or started locally when the rollout runs on
Ray (``rollout.backend=ray``) or the FSDP ranks do (``trainer.launcher=ray``)."""

from __future__ import annotations

import contextlib
from typing import Any

from agentloop_trainer.config.sections import TrainConfig


@contextlib.contextmanager
def ray_session(cfg: TrainConfig, log: Any) -> Any:
    """Join (``ray.address``) or start a local Ray cluster when the run uses Ray; a cluster this
    run started is stopped at the end. Yields ``ray`` or None (no Ray needed)."""
    from agentloop_trainer.config.accessors import uses_ray

    if not (uses_ray(cfg) or (cfg.trainer.fsdp_ranks > 1 and cfg.trainer.launcher == "ray")):
        yield None
        return
    import ray

    from agentloop_engines.fleet.hosting import connect_ray

    started = not ray.is_initialized()
    connect_ray(cfg.ray.address, num_cpus=cfg.ray.num_cpus, listen_on_network=cfg.ray.listen_on_network)
    resources = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
    log(f"Ray: {'joined ' + cfg.ray.address if cfg.ray.address else 'local cluster'} with "
        f"{len([n for n in ray.nodes() if n.get('Alive')])} node(s), {resources}")
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
