"""The engine server's routes that not every server has, and how ``/health`` names them.

A route added after the first servers shipped is listed in ``/health``'s ``optional_routes``,
so a client calls it only on a server that has it (an older server answers such a call 404).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FORGET_SESSION_PATH = "/forget_session"
"""``POST {request_ids: [...]}`` -> ``{forgotten: <how many ids>}``: the trajectories of those
ids are over, so the engine may drop what it keeps for them (``capabilities.forget_session``;
HFServer's prefix-cache entries; unknown ids are ignored). A chat route: the client that
generated with an id is the one that knows when it is done, and forgetting changes no output
(a later turn of that id is prefilled cold), only what the engine holds. 501 from an engine
that keeps nothing per trajectory."""

FORGET_BATCH = 1024
"""Most request ids in one ``/forget_session`` body (the server refuses more with 400)."""

OPTIONAL_ROUTES: tuple[str, ...] = (FORGET_SESSION_PATH,)
"""What this version's server lists in ``/health`` ``optional_routes``."""


def has_route(health: Mapping[str, Any], path: str) -> bool:
    """Whether the ``/health`` answer ``health`` lists ``path`` among its ``optional_routes``
    (a server from before the list has none)."""
    routes = health.get("optional_routes")
    return isinstance(routes, list) and path in routes
