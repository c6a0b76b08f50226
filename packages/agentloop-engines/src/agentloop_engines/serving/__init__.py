"""Serving engines over HTTP: the token-level engine server and the OpenAI-compatible gateway.

* :mod:`~agentloop_engines.serving.server`: ``create_app``, ``serve``, ``ServerThread`` (``/generate``,
  the control routes, and ``/v1`` through the gateway);
* :mod:`~agentloop_engines.serving.gateway`: the OpenAI/Anthropic-compatible gateway with
  per-session token recording;
* :mod:`~agentloop_engines.serving.common`: what every agentloop HTTP app shares (the request
  guard, connection deadlines from :mod:`~agentloop_engines.serving.watch`, error bodies from
  :mod:`~agentloop_engines.serving.error_shapes`, the control credential of
  :mod:`~agentloop_engines.serving.control`);
* :mod:`~agentloop_engines.serving.http_agent` (with
  :mod:`~agentloop_engines.serving.sync_agents`): the ``http_agent`` loop, which runs a user's
  agent against a gateway session.

The wire formats of ``/generate`` and ``/update_weights`` are :mod:`agentloop_engines.wire`'s
(both ends). The gateway knows the router's errors (:mod:`agentloop_engines.fleet.routing`) to
answer them as 503/504: serving sits above the fleet, never the other way.

Needs the ``[server]`` extra (``pip install "agentloop-engines[server]"``) to run an app; nothing
is imported here.
"""
