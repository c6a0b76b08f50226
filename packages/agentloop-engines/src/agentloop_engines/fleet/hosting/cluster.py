"""Joining a Ray cluster or starting a local one, and the one lazy ``import ray`` of agentloop.

Every module that hosts work on Ray (engine replicas, the shared client actor, the trainer's
FSDP ranks) gets Ray through :func:`import_ray`, so a missing Ray fails the same way
everywhere: an ImportError that prints the ``pip install`` line of the extra to add.

What Ray workers print (model and tool text among it) reaches this process's console only
escaped (:func:`escape_worker_output`): Ray copies worker stdout/stderr lines to the driver as
they are (``log_to_driver``), so an escape sequence in them would retitle, clear or rewrite the
terminal of whoever watches the run.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

from agentloop_core.console import console_safe

__all__ = ["connect_ray", "escape_worker_output", "import_ray", "init_local_ray"]

logger = logging.getLogger(__name__)


def import_ray(purpose: str, *, extra: str = "agentloop-engines[ray]") -> Any:
    """Import and return the ``ray`` module.

    Args:
        purpose: What needs Ray, for the message (e.g. ``"Ray hosting"``).
        extra: The extra that installs Ray for the caller's package.

    Raises:
        ImportError: without Ray, naming ``purpose`` and ``pip install "<extra>"``.
    """
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f'{purpose} needs Ray: pip install "{extra}"') from exc
    return ray


@functools.cache
def _remote_class(cls: type) -> Any:
    """``ray.remote(cls)``, wrapped once per class (the actor classes of this subpackage)."""
    return import_ray("Ray hosting").remote(cls)


def connect_ray(
    address: str | None = None,
    *,
    temp_dir: str | os.PathLike[str] | None = None,
    num_cpus: int | None = None,
    namespace: str | None = None,
    connect_timeout_s: float = 5.0,
    listen_on_network: bool = False,
    **init_kwargs: Any,
) -> Any:
    """Join a Ray cluster, or start a local one, and return the ``ray`` module.

    Args:
        address: ``"auto"`` (the cluster started on this machine with ``ray start --head``),
            ``"host:6379"`` (a head node's GCS) or ``"ray://host:10001"`` (Ray Client). None:
            start a local Ray with :func:`init_local_ray`.
        temp_dir: Session folder of a local Ray (None: a fresh temporary directory).
        num_cpus: CPUs of a local Ray (None: ``init_local_ray``'s default). Ignored when joining.
        namespace: Ray namespace, so named replicas are found across drivers.
        connect_timeout_s: How long to try a TCP connection to ``host:port`` before giving up
            (``ray.init`` itself retries an unreachable address for minutes).
        listen_on_network: Let a local Ray listen on every address of this machine (see
            :func:`init_local_ray`). Ignored when joining.
        **init_kwargs: Passed to ``ray.init``. ``log_to_driver`` (Ray's default when joining:
            on) copies the workers' output to this console, escaped.

    Returns:
        The ``ray`` module, initialised. An already initialised Ray is reused as it is.

    Raises:
        ImportError: without Ray.
        ConnectionError: when no cluster answers at ``address``, naming it and how to start one.
    """
    ray = import_ray("Joining a Ray cluster")
    if ray.is_initialized():
        return ray
    if address:
        host_port = _host_port(address)
        if host_port is not None:
            _probe(address, *host_port, connect_timeout_s)
        # Ray turns a loopback address into this machine's outward one before connecting; a
        # cluster listening on 127.0.0.1 only (init_local_ray's) is then unreachable wherever the
        # machine has a routable interface. Joined as a loopback node, the address stays.
        loopback = host_port is not None and _is_loopback(host_port[0])
        try:
            with _ray_listens_on_network(ray, False) if loopback else contextlib.nullcontext():
                ray.init(address=address, namespace=namespace, **init_kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConnectionError(_join_hint(address, exc)) from exc
        escape_worker_output()
        return ray
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix="agentloop-ray-")
    kwargs = dict(init_kwargs)
    if namespace is not None:
        kwargs["namespace"] = namespace
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    return init_local_ray(temp_dir, listen_on_network=listen_on_network, **kwargs)


def init_local_ray(temp_dir: str | os.PathLike[str], *, num_cpus: int = 2, object_store_mb: int = 256,
                   listen_on_network: bool = False, **init_kwargs: Any) -> Any:
    """Start a local Ray cluster sized for a small machine (no dashboard, bounded object store,
    session files under ``temp_dir``, no auth token written to ``~/.ray``) and return ``ray``.

    Every port of the cluster (GCS, raylet, object manager, runtime-env agent, the workers' and
    the driver's gRPC servers) listens on 127.0.0.1 only. Its authentication is off, so a
    cluster reachable from the network lets anyone who can reach the machine run code in it;
    Ray's own default on Linux is every address.

    Args:
        temp_dir: Session folder of the cluster.
        num_cpus: CPUs the cluster offers.
        object_store_mb: Size of the object store.
        listen_on_network: Listen on every address of this machine instead (Ray's default), for
            other machines to join this one. Unauthenticated: only on a network you trust.
        **init_kwargs: Passed to ``ray.init``. Workers' output stays in the session's log files
            (``log_to_driver=False``) unless ``log_to_driver=True``, which copies it to this
            console, escaped.

    Raises:
        ImportError: without Ray.
    """
    ray = import_ray("A local Ray cluster")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if listen_on_network:
        logger.warning("the local Ray cluster listens on every address of this machine (listen_on_network), "
                       "RAY_AUTH_MODE=%s: unless that is a token, anyone who can reach this machine can run "
                       "code in it", os.environ["RAY_AUTH_MODE"])
    kwargs = dict(num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store_mb * 2**20,
                  _temp_dir=str(temp_dir), **init_kwargs)
    kwargs.setdefault("log_to_driver", False)
    with _ray_listens_on_network(ray, listen_on_network):
        try:
            ray.init(**kwargs)
        except Exception as exc:
            # Ray waits a hard-coded 30 s for its raylet; on a saturated 2-core machine that can run
            # out once. A second failure is real and raises.
            if "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
            ray.init(**kwargs)
    escape_worker_output()
    return ray


def escape_worker_output() -> None:
    """Make every handler Ray gives worker output lines to (the one that prints them on this
    console when ``log_to_driver`` is on) see them :func:`~agentloop_core.console.console_safe`;
    idempotent. Call it after ``ray.init`` (which adds the handler); :func:`connect_ray` and
    :func:`init_local_ray` do."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    # Swapped under the dispatcher's lock: a batch emitted in between is neither lost nor raw.
    with dispatcher._lock:
        dispatcher.handlers = [(name, handler if isinstance(handler, _EscapedHandler) else _EscapedHandler(handler))
                               for name, handler in dispatcher.handlers]


class _EscapedHandler:
    """A Ray worker-output handler fed escaped lines (and actor and task names, which the
    printed prefix shows)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, data: dict[str, Any]) -> Any:
        safe = {k: console_safe(v) if k in ("actor_name", "task_name") and isinstance(v, str) else v
                for k, v in data.items()}
        safe["lines"] = [console_safe(line) for line in data.get("lines", [])]
        return self.inner(safe)


@contextlib.contextmanager
def _ray_listens_on_network(ray: Any, on: bool) -> Iterator[None]:
    """Ray binds its servers to the node's address, which it takes to be 127.0.0.1 only where
    its "cluster" switch is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read once, when ``ray``
    is imported: this process already has, so the module's constant is set too). The processes
    ``ray.init`` starts read the variable themselves; both are restored once they run, so a
    later ``ray.init(address=...)`` in this process finds its own address again."""
    constants = ray._private.ray_constants
    name = constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_flag = os.environ.get(name), constants.ENABLE_RAY_CLUSTER
    os.environ[name], constants.ENABLE_RAY_CLUSTER = ("1" if on else "0"), on
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved_env


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.removeprefix("ray://")
    if address == "auto" or ":" not in rest:
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _probe(address: str, host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(_join_hint(address, exc)) from exc


def _join_hint(address: str, exc: BaseException) -> str:
    return (
        f"cannot join the Ray cluster at ray.address={address!r}: {type(exc).__name__}: {exc}. "
        "Start one first: `ray start --head` on the head node (then use 'auto' there, or "
        "'<head-ip>:6379' elsewhere; 'ray://<head-ip>:10001' for Ray Client), or leave "
        "ray.address unset to start a local Ray in this process"
    )
