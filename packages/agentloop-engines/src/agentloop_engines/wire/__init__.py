"""The HTTP wire formats of the engine server, both ends: what
:class:`~agentloop_engines.fleet.http_client.EngineHTTPClient` writes and reads and what
:mod:`agentloop_engines.serving.server` reads and writes.

* :mod:`~agentloop_engines.wire.images`: the images of a ``POST /generate`` prompt;
* :mod:`~agentloop_engines.wire.stream`: a streamed ``POST /generate`` (one JSON object a line);
* :mod:`~agentloop_engines.wire.weights`: the body of ``POST /update_weights``;
* :mod:`~agentloop_engines.wire.routes`: the routes newer than the first servers
  (``/forget_session``), listed in ``/health`` so a client calls them only where they exist.

At the root, beside the engine interface (:mod:`~agentloop_engines.base`,
:mod:`~agentloop_engines.streaming`), so that the fleet's client and the serving room both
depend on it and neither on the other's side. Nothing is imported here.
"""
