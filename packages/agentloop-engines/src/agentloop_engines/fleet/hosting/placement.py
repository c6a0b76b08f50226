"""Placement on a Ray cluster: one resource check before anything starts, and placement groups
for engine replicas and trainer ranks.

Ray leaves an actor or placement group whose resources can never be met pending forever,
without an error. Every start-up path (engine replicas, the trainer's FSDP ranks) therefore
goes through :func:`check_resources`, which compares the request with the cluster's alive
nodes and raises :class:`InsufficientResourcesError` naming the missing resource, what the
cluster has (or has free now) and the config knobs to change.

Ray is imported lazily; importing this module does not import it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_engines.fleet.hosting.cluster import import_ray

logger = logging.getLogger(__name__)

__all__ = [
    "PLACEMENT_STRATEGIES",
    "InsufficientResourcesError",
    "bundle_for",
    "check_resources",
    "check_strategy",
    "create_placement_group",
    "placement_group_for_ranks",
    "rank_scheduling_strategy",
    "remove_placement_group",
    "wait_placement_group",
]

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Ray accounts resources in units of 1e-4; anything smaller is rounding noise.
_EPS = 1e-6
# Past this many bundles the exact packing search gives up and assumes Ray can place them.
_SEARCH_LIMIT = 20000
# Ray's view of free resources lags (a just-removed group still shows as held for a moment).
_AVAILABLE_WAIT_S = 5.0
_FREE_THEM = ("free them (ray.kill / remove_placement_group / stop_replicas) or wait, then retry")


class InsufficientResourcesError(RuntimeError):
    """The cluster cannot hold what was asked for, or not within the timeout.

    Raised by engine replicas and trainer ranks alike, before any actor is started (a
    placement group that was reserved for the request is removed first). The message names
    the missing resource, what the cluster has (or has free now) and the config knobs to change.
    """


def check_strategy(strategy: str) -> str:
    """Return ``strategy`` if it is one of :data:`PLACEMENT_STRATEGIES`.

    Raises:
        ValueError: naming the valid strategies.
    """
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; valid: {', '.join(PLACEMENT_STRATEGIES)}")
    return strategy


# ---- resource checks --------------------------------------------------------------------------


def bundle_for(num_cpus: float, num_gpus: float = 0, resources: Mapping[str, float] | None = None) -> dict[str, float]:
    """The placement-group bundle of one replica or rank.

    Raises:
        ValueError: for negative amounts or an empty bundle (Ray rejects those).
    """
    bundle = {k: float(v) for k, v in dict(resources or {}).items() if v}
    if num_cpus < 0 or num_gpus < 0:
        raise ValueError(f"num_cpus and num_gpus must be >= 0, got num_cpus={num_cpus}, num_gpus={num_gpus}")
    if num_cpus > 0:
        bundle["CPU"] = float(num_cpus)
    if num_gpus > 0:
        bundle["GPU"] = float(num_gpus)
    if not bundle:
        raise ValueError("a placement bundle needs num_cpus > 0, num_gpus > 0 or a custom resource")
    return bundle


def check_resources(
    bundles: Sequence[Mapping[str, float]],
    *,
    strategy: str = "PACK",
    what: str = "the request",
    fix: str = "lower the request or add nodes",
    available_wait_s: float = _AVAILABLE_WAIT_S,
) -> None:
    """Fail fast when the cluster cannot place ``bundles``; call it BEFORE starting anything.

    Checks, against the alive nodes: the summed request per resource; that each bundle fits
    one node; what the strategy demands (``STRICT_PACK``: one node holds every bundle;
    ``STRICT_SPREAD``: every bundle on its own node; ``PACK``/``SPREAD``: the bundles pack
    into the nodes); and then the same against what is *available* now, since resources held
    by other actors or placement groups leave a new actor pending forever.

    Args:
        bundles: One resource mapping per replica or rank, e.g. ``{"CPU": 1, "GPU": 1}``.
        strategy: One of :data:`PLACEMENT_STRATEGIES`.
        what: What the bundles are, for the message (e.g. ``"4 engine replicas x
            {'CPU': 1, 'GPU': 1}"``).
        fix: The config knobs to change, for the message.
        available_wait_s: How long resources that are held now may take to be freed before
            that is an error (Ray's view of free resources lags by a moment). Held resources
            fail fast: a request behind them would wait with nothing said.

    Raises:
        ValueError: an unknown strategy or an empty bundle list.
        InsufficientResourcesError: naming the missing resource, what the cluster has, its
            nodes, and ``fix``.
    """
    check_strategy(strategy)
    ray = import_ray("Ray placement")
    bundles = [{k: float(v) for k, v in b.items() if v} for b in bundles]
    if not bundles:
        raise ValueError("check_resources needs at least one bundle")
    nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    totals = {nid: {k: float(v) for k, v in n.get("Resources", {}).items()} for nid, n in nodes.items()}
    names = sorted({k for b in bundles for k in b})
    desc = _describe_nodes(nodes, totals, names)
    problem = _placement_problem(bundles, totals, strategy, names)
    if problem:
        raise InsufficientResourcesError(f"{what}: {problem} (nodes: {desc}); {fix}")
    # The per-node view of free resources lags (a just-removed placement group still shows as
    # held for a moment), so give it a few seconds before calling resources taken.
    deadline = time.monotonic() + available_wait_s
    while True:
        available = _available_per_node(ray, set(totals))
        problem = None if available is None else _placement_problem(bundles, available, strategy, names)
        if problem is None or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if problem and available is not None:
        raise InsufficientResourcesError(
            f"{what}: the cluster is big enough but other actors or placement groups hold its "
            f"resources; after {available_wait_s:g}s still {problem} (free now: "
            f"{_describe_nodes(nodes, available, names)}); {_FREE_THEM}; or {fix}"
        )


def _available_per_node(ray: Any, alive: set[str]) -> dict[str, dict[str, float]] | None:
    # A DeveloperAPI of ray._private.state; without it only the totals are checked.
    try:
        from ray._private.state import available_resources_per_node

        per_node = available_resources_per_node()
    except Exception as exc:  # noqa: BLE001 - a best-effort refinement of the check
        logger.debug("per-node available resources unknown (%s); checking totals only", exc)
        return None
    return {nid: {k: float(v) for k, v in res.items()} for nid, res in per_node.items() if nid in alive}


def _describe_nodes(nodes: Mapping[str, Any], res: Mapping[str, Mapping[str, float]], names: Sequence[str]) -> str:
    parts = []
    for nid in sorted(res):
        have = ", ".join(f"{k} {res[nid].get(k, 0.0):g}" for k in names)
        parts.append(f"{nodes[nid].get('NodeManagerAddress', '?')}/{nid[:8]} ({have})")
    return "; ".join(parts) or "no alive node"


def _fits(bundle: Mapping[str, float], cap: Mapping[str, float]) -> bool:
    return all(cap.get(k, 0.0) + _EPS >= v for k, v in bundle.items())


def _placement_problem(
    bundles: list[dict[str, float]], nodes: Mapping[str, Mapping[str, float]], strategy: str, names: Sequence[str]
) -> str | None:
    """Why ``bundles`` cannot be placed on ``nodes`` (per-node resources), or None."""
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in names}
    have = {k: sum(n.get(k, 0.0) for n in nodes.values()) for k in names}
    short = [k for k in names if have[k] + _EPS < need[k]]
    if short:
        return ", ".join(f"need {k}: {need[k]:g}, the cluster has {k}: {have[k]:g}" for k in short)
    for b in bundles:
        if not any(_fits(b, cap) for cap in nodes.values()):
            biggest = {k: max((n.get(k, 0.0) for n in nodes.values()), default=0.0) for k in b}
            return (f"one bundle {_fmt(b)} fits on no single node (the largest node has "
                    f"{_fmt(biggest)}); a replica or rank never spans nodes")
    if strategy == "STRICT_PACK":
        if not any(_fits(need, cap) for cap in nodes.values()):
            return (f"STRICT_PACK puts all bundles on one node, which needs {_fmt(need)}; no node has "
                    "that much (use PACK or SPREAD, or smaller bundles)")
    elif strategy == "STRICT_SPREAD":
        placed = _spread_matching(bundles, nodes)
        if placed < len(bundles):
            return (f"STRICT_SPREAD puts each of the {len(bundles)} bundles on its own node, but only "
                    f"{placed} node(s) can each hold one (use SPREAD or PACK, or add nodes)")
    elif not _packs(bundles, [dict(cap) for cap in nodes.values()]):
        return f"the {len(bundles)} bundles {_fmt(bundles[0])}... do not pack into the nodes' resources"
    return None


def _fmt(res: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def _spread_matching(bundles: list[dict[str, float]], nodes: Mapping[str, Mapping[str, float]]) -> int:
    """Size of a maximum matching of bundles to distinct nodes (Kuhn's augmenting paths)."""
    caps = list(nodes.values())
    owner: list[int | None] = [None] * len(caps)

    def augment(i: int, seen: set[int]) -> bool:
        for j, cap in enumerate(caps):
            if j in seen or not _fits(bundles[i], cap):
                continue
            seen.add(j)
            holder = owner[j]
            if holder is None or augment(holder, seen):
                owner[j] = i
                return True
        return False

    return sum(augment(i, set()) for i in range(len(bundles)))


def _packs(bundles: list[dict[str, float]], caps: list[dict[str, float]]) -> bool:
    """Whether the bundles fit into the nodes (exact search, biggest bundles first)."""
    order = sorted(bundles, key=lambda b: sorted(b.items(), key=lambda kv: -kv[1]), reverse=True)
    budget = [_SEARCH_LIMIT]

    def place(i: int) -> bool:
        if i == len(order):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return True  # too big to search exactly: let Ray try (it still times out cleanly)
        tried: set[tuple[tuple[str, float], ...]] = set()
        for cap in caps:
            key = tuple(sorted(cap.items()))
            if key in tried or not _fits(order[i], cap):
                continue  # identical free capacity gives the same outcome: skip symmetric branches
            tried.add(key)
            for k, v in order[i].items():
                cap[k] = cap.get(k, 0.0) - v
            ok = place(i + 1)
            for k, v in order[i].items():
                cap[k] += v
            if ok:
                return True
        return False

    return place(0)


# ---- placement groups -------------------------------------------------------------------------


def create_placement_group(
    bundles: Sequence[Mapping[str, float]],
    *,
    strategy: str,
    timeout_s: float,
    what: str,
    fix: str,
    name: str | None = None,
) -> Any:
    """Check, create and wait for a placement group; the one path of replicas and ranks.

    Args:
        bundles: One resource mapping per replica or rank.
        strategy: One of :data:`PLACEMENT_STRATEGIES`.
        timeout_s: How long to wait for the group to be reserved; it also bounds how long
            :func:`check_resources` waits for held resources to be freed.
        what: What the bundles are, for messages.
        fix: The config knobs to change, for messages.
        name: Optional group name (find it with ``ray.util.get_placement_group``).

    Returns:
        The ready ``PlacementGroup``.

    Raises:
        ValueError: an unknown strategy or an empty bundle list.
        InsufficientResourcesError: from :func:`check_resources` (nothing reserved), or from
            :func:`wait_placement_group` (the group is removed then).
    """
    from ray.util.placement_group import placement_group

    check_resources(bundles, strategy=strategy, what=what, fix=fix,
                    available_wait_s=min(_AVAILABLE_WAIT_S, timeout_s))
    pg = placement_group([dict(b) for b in bundles], strategy=strategy, name=name or "")
    try:
        wait_placement_group(pg, timeout_s=timeout_s, what=what, fix=fix)
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg


def wait_placement_group(pg: Any, *, timeout_s: float, what: str, fix: str) -> None:
    """Wait until ``pg`` is reserved.

    Args:
        pg: The placement group.
        timeout_s: How long to wait.
        what: What the group is for, for the message.
        fix: The config knobs to change, for the message.

    Raises:
        InsufficientResourcesError: when it is not ready in time, naming the resources free now
            and the cluster's totals (the caller decides whether to remove the group).
    """
    ray = import_ray("Ray placement")
    if pg.wait(timeout_seconds=timeout_s):
        return
    names = sorted({k for b in pg.bundle_specs for k in b} | {"CPU", "GPU"})
    free = {k: float(ray.available_resources().get(k, 0.0)) for k in names}
    total = {k: float(ray.cluster_resources().get(k, 0.0)) for k in names}
    raise InsufficientResourcesError(
        f"{what}: the {pg.bundle_count}-bundle placement group {_fmt(pg.bundle_specs[0])}... was not ready "
        f"after {timeout_s:g}s; free now: {_fmt(free)}, the cluster has {_fmt(total)}; other actors or "
        f"placement groups probably hold the resources: {_FREE_THEM} (or a longer timeout); or {fix}"
    )


def placement_group_for_ranks(
    world_size: int,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    strategy: str = "PACK",
    timeout_s: float = 300.0,
    resources: Mapping[str, float] | None = None,
    name: str | None = None,
) -> Any:
    """A ready placement group with one bundle per trainer rank, for FSDP rank actors.

    Schedule rank ``r`` with ``rank_scheduling_strategy(pg, r)`` and the same ``num_cpus`` /
    ``num_gpus`` as here; remove the group with :func:`remove_placement_group` when the
    ranks are done. PACK keeps ranks on few nodes (fast collectives); STRICT_PACK demands one
    node; SPREAD / STRICT_SPREAD put ranks on different nodes.

    Args:
        world_size: Number of ranks (bundles).
        num_cpus: CPUs per rank (config ``ray.rank_num_cpus``).
        num_gpus: GPUs per rank (config ``ray.rank_num_gpus``).
        strategy: One of :data:`PLACEMENT_STRATEGIES` (config ``ray.placement_strategy``).
        timeout_s: How long to wait for the group to be reserved.
        resources: Extra custom resources per rank (e.g. ``{"trainer_node": 1}``).
        name: Optional group name (find it with ``ray.util.get_placement_group``).

    Returns:
        The ready ``PlacementGroup``.

    Raises:
        ValueError: ``world_size < 1``, an unknown strategy or an empty bundle.
        InsufficientResourcesError: the cluster cannot hold the ranks (checked before anything
            is reserved) or the group was not ready in time.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_strategy(strategy)
    bundle = bundle_for(num_cpus, num_gpus, resources)
    return create_placement_group(
        [bundle] * world_size,
        strategy=strategy,
        timeout_s=timeout_s,
        what=f"{world_size} FSDP trainer rank(s) x {_fmt(bundle)}, strategy {strategy}",
        fix=("lower trainer.fsdp_ranks or ray.rank_num_cpus / ray.rank_num_gpus, pick another "
             "ray.placement_strategy, or add nodes"),
        name=name,
    )


def rank_scheduling_strategy(pg: Any, rank: int) -> Any:
    """The Ray scheduling strategy that puts rank ``rank`` into bundle ``rank`` of ``pg``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)


def remove_placement_group(pg: Any) -> None:
    """Release a placement group's reservation (its actors are killed by Ray); never raises for
    a group that is already gone."""
    from ray.util.placement_group import remove_placement_group as _remove

    try:
        _remove(pg)
    except Exception as exc:  # noqa: BLE001 - removal is cleanup; a vanished group is fine
        logger.debug("placement group removal: %s", exc)
