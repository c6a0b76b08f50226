"""Deprecated: use :mod:`agentloop_engines.hosting` (removed in the next release).

A thin shim kept one release; every name it exports is the object of ``agentloop_engines.hosting``.
"""
# ruff: noqa: F405 - the names in __all__ come from the star import

import warnings

# The shim is hosting under its old name: a star import keeps one list of what hosting has.
from agentloop_engines.hosting import *  # noqa: F403

# The names this module exported before the move.
__all__ = [
    "PLACEMENT_STRATEGIES", "ClientActor", "InsufficientResourcesError", "RemoteClient", "ServerActor",
    "bundle_for", "check_resources", "client_actor", "connect_ray", "create_placement_group",
    "find_replicas", "init_local_ray", "local_client", "placement_group_for_ranks",
    "rank_scheduling_strategy", "remove_placement_group", "replica_nodes", "start_replicas",
    "stop_replicas",
]

warnings.warn(
    "agentloop_engines.ray_hosting is deprecated and will be removed in the next release; import from "
    "agentloop_engines.hosting instead (e.g. `from agentloop_engines.hosting import start_replicas`)",
    DeprecationWarning,
    stacklevel=2,
)
