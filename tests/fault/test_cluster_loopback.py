"""The local Ray cluster the trainer starts for itself runs with authentication off, so every
port it listens on must be on loopback: a port on the network lets anyone who can reach the
machine run code in the cluster (and so in the trainer). Ray's own default on Linux is every
address; ``init_local_ray`` / ``connect_ray`` turn that off unless ``listen_on_network=True``.

Each test starts the cluster in a fresh interpreter (Ray reads its switch when imported, and a
test environment that sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` would hide the default), reads
every TCP port its processes listen on from ``/proc`` and tries to connect to each through the
machine's non-loopback addresses. Debugging: the failure lists ``process address:port``; a
process missing from the list is one ``init_local_ray`` did not start with the switch.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason='the cluster tests need Ray: pip install "agentloop-engines[ray]"')

DRIVER = r"""
import json, os, socket, sys, tempfile

from agentloop_engines.fleet.hosting import init_local_ray


def tree(root):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [root], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def listening():
    # inode -> (address, port) of every listening TCP socket of this network namespace
    table = {}
    for name, family in (("tcp", 4), ("tcp6", 6)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                if family == 4:
                    addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                table[fields[9]] = (addr, int(hex_port, 16))
    return table


ray = init_local_ray(tempfile.mkdtemp(prefix="agentloop-loopback-"), num_cpus=1,
                     listen_on_network=json.loads(sys.argv[1]))


@ray.remote(num_cpus=0.25)
class Probe:
    def ping(self):
        return os.getpid()


actor = Probe.remote()
ray.get(actor.ping.remote(), timeout=120)  # a worker started after init listens too
sockets = listening()
found = []
for pid in tree(os.getpid()):
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        if inode in sockets:
            found.append({"pid": pid, "process": comm, "address": sockets[inode][0], "port": sockets[inode][1]})
reached = []
for address in sys.argv[2:]:
    for entry in found:
        with socket.socket() as s:
            s.settimeout(3)
            if s.connect_ex((address, entry["port"])) == 0:
                reached.append(f"{entry['process']} via {address}:{entry['port']}")
print("RESULT " + json.dumps({"listening": found, "reached": reached}))
ray.shutdown()
"""


def _host_addresses() -> list[str]:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return []
    return [a for a in out.split() if not ipaddress.ip_address(a).is_loopback and ":" not in a]


def _start_cluster(listen_on_network: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(listen_on_network), *_host_addresses()],
                          capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parent)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"the cluster did not start (exit {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_the_local_cluster_listens_on_loopback_only():
    """Every TCP port of the cluster ``init_local_ray`` starts (GCS, raylet and object manager,
    runtime-env agent, the driver's and the workers' gRPC servers) is bound to a loopback
    address, and none answers on the machine's other addresses. Before: Ray's default, every
    port on ``::`` (all addresses) with authentication off."""
    result = _start_cluster(listen_on_network=False)
    listening = result["listening"]
    processes = {entry["process"] for entry in listening}
    assert {"gcs_server", "raylet"} <= processes, f"the cluster's servers were not found: {listening}"
    exposed = [f"{e['process']} {e['address']}:{e['port']}" for e in listening if not _loopback(e["address"])]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert result["reached"] == [], f"reachable from the network: {result['reached']}"


@pytest.mark.skipif(not _host_addresses(), reason="this machine has no non-loopback IPv4 address to check against")
def test_listen_on_network_is_the_explicit_opt_out():
    """``listen_on_network=True`` (for other machines to join) binds the cluster beyond loopback,
    as Ray does by default; this also shows the check above can see an exposed port."""
    result = _start_cluster(listen_on_network=True)
    exposed = [e for e in result["listening"] if not _loopback(e["address"])]
    assert any(e["process"] == "gcs_server" for e in exposed), result["listening"]
    assert result["reached"], result


JOINER = r"""
import sys, tempfile, time
import ray._private.services as services
from agentloop_engines.fleet.hosting import connect_ray, init_local_ray

if sys.argv[1] == "hold":
    ray = init_local_ray(tempfile.mkdtemp(prefix="agentloop-join-"), num_cpus=1)
    print("GCS " + ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()
else:
    # A machine with a routable interface: Ray's guess of this node's outward address (TEST-NET-1,
    # which nothing answers) is what it would put in place of 127.0.0.1.
    services.node_ip_address_from_perspective = lambda address=None: "192.0.2.1"
    start = time.monotonic()
    ray = connect_ray(sys.argv[1])
    print("JOINED", ray.get_runtime_context().gcs_address, round(time.monotonic() - start, 1), flush=True)
    ray.shutdown()
"""


def test_a_driver_joins_a_loopback_cluster_at_its_loopback_address():
    """``connect_ray("127.0.0.1:port")`` on a machine whose outward address is not where the
    loopback-only cluster listens: Ray would rewrite the address to that outward one and retry it
    for minutes; joined as a loopback node, the address stays."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"RAY_AUTH_MODE": "disabled"}
    holder = subprocess.Popen([sys.executable, "-c", JOINER, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=env, text=True, start_new_session=True)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        while line and not line.startswith("GCS "):
            line = holder.stdout.readline()
        address = line.split()[1]
        joined = subprocess.run([sys.executable, "-c", JOINER, address], capture_output=True, text=True, env=env,
                                timeout=120, check=False)
        assert f"JOINED {address}" in joined.stdout, (joined.stdout + joined.stderr)[-3000:]
    finally:
        holder.kill()
        holder.wait()
        if holder.stdin is not None:
            holder.stdin.close()
        if holder.stdout is not None:
            holder.stdout.close()
