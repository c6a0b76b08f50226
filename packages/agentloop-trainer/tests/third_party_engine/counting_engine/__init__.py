"""A third-party engine package for agentloop's plug-in test (see ``plugin``)."""
