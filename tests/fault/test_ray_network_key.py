"""``ray.listen_on_network`` reaches every place the trainer starts or joins Ray: the engines'
``connect_ray`` took ``listen_on_network`` (a local cluster on loopback unless it is set), but the
trainer never passed it, so a run could not open its local cluster to other machines from the
config, and nothing pinned that its default stays loopback.

Each test calls the trainer's real entry point (``ray_session``, the rollout fleet's
``_start_ray``, the FSDP rank body ``_train_rank``) with ``connect_ray`` replaced by a recorder
that stops the call there, before any Ray starts; that the value then binds the cluster to
loopback or not is ``test_cluster_loopback.py``'s (on a real cluster).

How to debug a failure: ``listen_on_network`` missing from the recorded call means that call site
dropped it (``rollout/ray_session.py``, ``rollout/rollouts.py``, ``stages/build.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

import agentloop_engines.fleet.hosting as hosting
from agentloop_trainer.config import load_config
from agentloop_trainer.config.loading import to_yaml


class Stop(Exception):
    """Raised by the recorder: the call got as far as ``connect_ray``."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def recorder(address: str | None = None, **kwargs: Any) -> Any:
        seen.append({"address": address, **kwargs})
        raise Stop

    monkeypatch.setattr(hosting, "connect_ray", recorder)
    return seen


def _entry_points(cfg: Any) -> dict[str, Any]:
    from agentloop_trainer.rollout.rollouts import RolloutFleet
    from agentloop_trainer.stages.build import _train_rank
    from agentloop_trainer.stages.rollout_setup import ray_session

    def session() -> None:
        with ray_session(cfg, print):
            pass

    return {
        "ray_session": session,
        "RolloutFleet._start_ray": lambda: RolloutFleet._start_ray(None, cfg.ray, 1, "sync"),  # type: ignore[arg-type]
        "_train_rank": lambda: _train_rank(0, to_yaml(cfg), "unused-model", "unused-run"),
    }


@pytest.mark.parametrize("value", [None, False, True], ids=["default", "false", "true"])
def test_ray_listen_on_network_reaches_connect_ray(calls, value):
    """Every entry point passes ``listen_on_network`` from the config: False by default (the
    local cluster on 127.0.0.1 only), and the value set with ``ray.listen_on_network``."""
    overrides = ["actor_rollout_ref.rollout.backend=ray"]
    if value is not None:
        overrides.append(f"ray.listen_on_network={str(value).lower()}")
    cfg = load_config(overrides)
    assert cfg.ray.listen_on_network is bool(value)
    for name, call in _entry_points(cfg).items():
        calls.clear()
        with pytest.raises(Stop):
            call()
        assert len(calls) == 1, f"{name} did not call connect_ray once: {calls}"
        assert calls[0].get("listen_on_network") is bool(value), f"{name} passed {calls[0]}"

