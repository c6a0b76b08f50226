"""Ray hosting: ReplicaActor replicas, failover when one is killed, the shared client actor."""

from __future__ import annotations

import asyncio
import functools
import sys
import time

import pytest

from agentloop_core.testing import ScriptedServer

ray = pytest.importorskip("ray", reason='Ray hosting tests need: pip install "agentloop-engines[ray]"')

from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_engines.fleet.hosting import (  # noqa: E402
    RemoteClient,
    client_actor,
    init_local_ray,
    local_client,
    start_replicas,
)

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    init_local_ray(tmp_path_factory.mktemp("ray"))
    yield
    ray.shutdown()


@pytest.mark.fault
async def test_killing_a_replica_mid_run_loses_no_request(ray_cluster):
    handles = start_replicas(functools.partial(ScriptedServer, latency_s=0.5), 2, name_prefix="kill-test")
    try:
        assert ray.get_actor("kill-test-1") is not None  # found by name
        client = local_client(handles)
        assert isinstance(client, LLMServerClient)
        tasks = [asyncio.create_task(client.generate(f"r{i}", [1, 2, i], {"max_tokens": 4, "seed": i}))
                 for i in range(16)]
        await asyncio.sleep(0.2)
        assert client.in_flight == [8, 8]
        ray.kill(handles[1])
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        assert len(outs) == 16
        assert all(len(o.token_ids) == 4 for o in outs)
        assert {o.extra["replica"] for o in outs} == {0}
        assert client.healthy_replicas == [0]
        assert client.in_flight == [0, 0]
        assert client.stats["retries"] == 8
        # Outputs are the engine's, unchanged by the failover (ScriptedServer is prompt-seeded).
        ref = ScriptedServer()
        for i, out in enumerate(outs):
            expect = await ref.generate("x", [1, 2, i], {"max_tokens": 4, "seed": i})
            assert out.token_ids == expect.token_ids
    finally:
        for h in handles:
            ray.kill(h)


async def test_shared_client_actor_balances_requests_from_several_workers(ray_cluster):
    # Each request takes 3 s and both workers start sending together (a gate), so all 12 are in
    # flight at once whatever the process start-up times: the split is then exactly 6/6.
    handles = start_replicas(functools.partial(ScriptedServer, latency_s=3.0), 2, name_prefix="shared")
    try:
        remote = client_actor(handles, name="shared-client", imbalance_threshold=4)
        assert isinstance(remote, RemoteClient)

        @ray.remote(num_cpus=0)
        class Gate:
            def __init__(self):
                self.opened, self.waiting = asyncio.Event(), 0

            async def wait(self):
                self.waiting += 1
                await self.opened.wait()

            def num_waiting(self):
                return self.waiting

            def open(self):
                self.opened.set()

        gate = Gate.remote()

        @ray.remote(num_cpus=0.1)
        def worker(proxy: RemoteClient, wid: int) -> list[int]:
            async def run():
                outs = await asyncio.gather(*(proxy.generate(f"w{wid}-{i}", [3, 4, i], {"max_tokens": 3})
                                              for i in range(6)))
                return [o.extra["replica"] for o in outs]
            ray.get(gate.wait.remote())
            return asyncio.run(run())

        refs = [worker.remote(remote, w) for w in range(2)]
        deadline = time.monotonic() + 60
        while ray.get(gate.num_waiting.remote()) < 2:
            assert time.monotonic() < deadline, "the two worker tasks did not start within 60 s"
            await asyncio.sleep(0.05)
        gate.open.remote()
        served = ray.get(refs, timeout=60)
        flat = [r for per_worker in served for r in per_worker]
        # One routing view: 12 concurrent requests split evenly over the two replicas. Two
        # clients each with their own counts could not guarantee this split.
        assert sorted(flat) == [0] * 6 + [1] * 6
        stats = await remote.get_stats()
        assert stats["routed"] == 12
        assert stats["in_flight"] == [0, 0]
        again = RemoteClient.from_name("shared-client")
        out = await again.generate("w0-1", [3, 4, 1, 9], {"max_tokens": 2})
        assert out.extra["replica"] == served[0][1]  # sticky across proxies
        with pytest.raises(ValueError, match="did you mean"):
            await again.generate("x", [1], {"temprature": 0.5})
        ray.kill(remote.actor)
    finally:
        for h in handles:
            ray.kill(h)


def test_missing_ray_names_the_extra(monkeypatch):
    from agentloop_engines.fleet.hosting import cluster, connect_ray, import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    cluster._remote_class.cache_clear()
    with pytest.raises(ImportError, match=r'Ray hosting needs Ray: pip install "agentloop-engines\[ray\]"'):
        start_replicas(ScriptedServer, 1)
    with pytest.raises(ImportError, match=r'pip install "agentloop-engines\[ray\]"'):
        connect_ray()
    with pytest.raises(ImportError, match=r'Running FSDP ranks needs Ray: pip install "agentloop-trainer\[ray\]"'):
        import_ray("Running FSDP ranks", extra="agentloop-trainer[ray]")
    cluster._remote_class.cache_clear()
