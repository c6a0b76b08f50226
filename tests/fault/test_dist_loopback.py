"""The torch.distributed rendezvous of the FSDP ranks listens on loopback when every rank runs on
this machine: torch's own store (``init_process_group`` with ``MASTER_ADDR=127.0.0.1``) listened
on every address of rank 0's machine, unauthenticated, so anyone who could reach the port could
write into the rendezvous of a training run; ranks on Ray asked for a port on all interfaces.

Each test runs two gloo ranks (``torch.multiprocessing`` through ``update.fsdp.spawn``, and Ray
actors through ``update.ray_ranks.spawn_ray`` on the suite's local cluster); rank 0 reads which
addresses listen on ``MASTER_PORT`` from ``/proc/net/tcp*`` and tries to connect to it through
this machine's non-loopback addresses.

How to debug a failure: ``::`` or ``0.0.0.0`` in the listed addresses means the store was made by
torch (``init_process_group`` without ``store=``), not by ``update.fsdp.rendezvous_store``; a
node address on one machine means ``spawn_ray`` did not use ``rendezvous_address``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the rendezvous tests need torch")

sys.path.insert(0, str(Path(__file__).parent))  # the ranks import this module's rank function


def _host_addresses() -> list[str]:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return []
    return [a for a in out.split() if not ipaddress.ip_address(a).is_loopback and ":" not in a]


def _listening(port: int) -> list[str]:
    """The addresses a TCP socket listens on ``port`` at (this network namespace)."""
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                hex_addr, hex_port = fields[1].split(":")
                if fields[3] != "0A" or int(hex_port, 16) != port:
                    continue
                raw = bytes.fromhex(hex_addr)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, words))
    return found


def report_rendezvous(rank: int, host_addresses: list[str]) -> dict | None:
    """On rank 0: ``MASTER_ADDR``, the addresses listening on ``MASTER_PORT``, and which of this
    machine's other addresses accepted a connection to it."""
    if rank != 0:
        return None
    port = int(os.environ["MASTER_PORT"])
    reached = []
    for address in host_addresses:
        with socket.socket() as s:
            s.settimeout(5)
            if s.connect_ex((address, port)) == 0:
                reached.append(address)
    return {"master_addr": os.environ["MASTER_ADDR"], "listening": _listening(port), "reached": reached}


def _assert_loopback_only(out: dict) -> None:
    assert out["master_addr"] == "127.0.0.1", out
    assert out["listening"], f"nothing listens on MASTER_PORT: {out}"
    assert all(ipaddress.ip_address(a).is_loopback for a in out["listening"]), out
    assert out["reached"] == [], f"the rendezvous answered on {out['reached']}: {out}"


def test_spawned_ranks_rendezvous_on_loopback_only():
    """Two ranks from ``update.fsdp.spawn``: the store listens on 127.0.0.1 only, and no other
    address of this machine reaches it (before: listening on ``::``)."""
    from agentloop_trainer.update.fsdp import spawn

    os.environ.pop("MASTER_ADDR", None)  # the default, not a value a previous test left
    _assert_loopback_only(spawn(report_rendezvous, 2, _host_addresses()))


def test_ray_ranks_on_one_node_rendezvous_on_loopback_only(ray_cluster):
    """Two ranks as Ray actors on this machine's cluster: the same (before: ``free_port(host="")``
    and the node address, the store on every address)."""
    from ray import cloudpickle

    from agentloop_trainer.update.ray_ranks import spawn_ray

    # Ray workers do not have this folder on sys.path: ship the rank function by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        out = spawn_ray(report_rendezvous, 2, _host_addresses(), num_cpus_per_rank=0.5, timeout_s=120,
                        run_timeout_s=300)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    _assert_loopback_only(out)


def test_ranks_on_several_nodes_meet_at_rank_zeros_node():
    """Ranks on one node meet at 127.0.0.1; on several, at rank 0's node address (the store then
    listens there only, never on every address)."""
    from agentloop_trainer.update.ray_ranks import rendezvous_address

    assert rendezvous_address(["10.0.0.5", "10.0.0.5"]) == "127.0.0.1"
    assert rendezvous_address(["10.0.0.5", "10.0.0.6", "10.0.0.5"]) == "10.0.0.5"
