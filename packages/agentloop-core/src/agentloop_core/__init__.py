"""agentloop-core: the protocol every agentloop package builds on."""
