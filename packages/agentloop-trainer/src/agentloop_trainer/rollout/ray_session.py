"""The Ray cluster of a run: joined (``ray.address``) or started locally when the rollout runs on
Ray (``rollout.backend=ray``) or the FSDP ranks do (``trainer.launcher=ray``)."""

from __future__ import annotations

import contextlib
from typing import Any

from agentloop_trainer.rollout.settings import RaySection


@contextlib.contextmanager
def ray_session(ray_section: RaySection, log: Any, *, needed: bool) -> Any:
    """Join (``ray.address``) or start a local Ray cluster when the run uses Ray (``needed``: the
    rollout runs on Ray, or the FSDP ranks do); a cluster this run started is stopped at the
    end. Yields ``ray`` or None (no Ray needed)."""
    if not needed:
        yield None
        return
    import ray

    from agentloop_engines.fleet.hosting import connect_ray

    started = not ray.is_initialized()
    connect_ray(ray_section.address, num_cpus=ray_section.num_cpus, listen_on_network=ray_section.listen_on_network)
    resources = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
    log(f"Ray: {'joined ' + ray_section.address if ray_section.address else 'local cluster'} with "
        f"{len([n for n in ray.nodes() if n.get('Alive')])} node(s), {resources}")
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
