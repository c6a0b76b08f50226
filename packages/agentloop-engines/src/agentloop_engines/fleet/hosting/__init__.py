"""Hosting on Ray, one concept a module:

* :mod:`~agentloop_engines.fleet.hosting.cluster`: :func:`import_ray` (the one lazy ``import ray``),
  :func:`connect_ray` and :func:`init_local_ray`;
* :mod:`~agentloop_engines.fleet.hosting.placement`: the resource check (:func:`check_resources`,
  :class:`InsufficientResourcesError`) and placement groups for replicas and trainer ranks;
* :mod:`~agentloop_engines.fleet.hosting.replicas`: engines as :class:`ReplicaActor` replicas
  (:func:`start_replicas`, :func:`find_replicas`, :func:`stop_replicas`, :class:`ReplicaSet`);
* :mod:`~agentloop_engines.fleet.hosting.client_actor`: one shared client as a Ray actor
  (:func:`client_actor`, :class:`RemoteClient`).

Ray is imported lazily; importing this package does not import it.
"""

from agentloop_engines.fleet.hosting.client_actor import ClientActor, RemoteClient, client_actor, local_client
from agentloop_engines.fleet.hosting.cluster import connect_ray, import_ray, init_local_ray
from agentloop_engines.fleet.hosting.placement import (
    PLACEMENT_STRATEGIES,
    InsufficientResourcesError,
    bundle_for,
    check_resources,
    check_strategy,
    create_placement_group,
    placement_group_for_ranks,
    rank_scheduling_strategy,
    remove_placement_group,
    wait_placement_group,
)
from agentloop_engines.fleet.hosting.replicas import (
    ReplicaActor,
    ReplicaSet,
    find_replicas,
    replica_nodes,
    start_replicas,
    stop_replicas,
)

__all__ = [
    "PLACEMENT_STRATEGIES",
    "ClientActor",
    "InsufficientResourcesError",
    "RemoteClient",
    "ReplicaSet",
    "ReplicaActor",
    "bundle_for",
    "check_resources",
    "check_strategy",
    "client_actor",
    "connect_ray",
    "create_placement_group",
    "find_replicas",
    "import_ray",
    "init_local_ray",
    "local_client",
    "placement_group_for_ranks",
    "rank_scheduling_strategy",
    "remove_placement_group",
    "replica_nodes",
    "start_replicas",
    "stop_replicas",
    "wait_placement_group",
]
