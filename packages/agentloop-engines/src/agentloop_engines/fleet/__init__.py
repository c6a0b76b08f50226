"""The fleet: engine replicas and the router in front of them.

* :mod:`~agentloop_engines.fleet.client`: ``LLMServerClient``, the router (one ``AsyncServer`` in
  front of several replicas), with its fan-out calls (``client_fanout``), stream routing
  (``client_stream``) and counters (``client_stats``);
* :mod:`~agentloop_engines.fleet.routing`: the routing policy (pure, no I/O);
* :mod:`~agentloop_engines.fleet.replica_calls`: calling one replica and classifying its failures;
* :mod:`~agentloop_engines.fleet.weight_ledger`: which replicas hold the latest weights;
* :mod:`~agentloop_engines.fleet.http_client`: ``EngineHTTPClient``, a replica reached over HTTP
  (with ``http_body`` and ``http_errors``);
* :mod:`~agentloop_engines.fleet.hosting`: replicas and the router hosted on Ray.

Nothing is imported here.
"""
