"""Shared fixtures: the tiny tokenizer and a small random policy (fast on 2 cores), a local Ray
per module, and a spy on the groups each update trains."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer tests need torch")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # 2 cores shared by several processes: more threads only adds contention.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from agentloop_core.testing import load_tiny_tokenizer

    return load_tiny_tokenizer()


@pytest.fixture(scope="session")
def random_model_path(tmp_path_factory, tokenizer):
    """A randomly initialised tiny policy saved as a Hugging Face checkpoint."""
    from agentloop_trainer.policy import TinyModelConfig, build_tiny_policy

    path = tmp_path_factory.mktemp("random_policy")
    model = build_tiny_policy(tokenizer, seed=0, spec=TinyModelConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """A local 2-CPU Ray for the module (a module that ships its own functions to Ray workers
    defines its own, registering them for pickling by value)."""
    pytest.importorskip("ray", reason='needs Ray: pip install "agentloop-engines[ray]"')
    from agentloop_engines.fleet.hosting import init_local_ray

    ray = init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture
def count_trained_groups():
    """``count_trained_groups(trainer)`` makes the trainer's every update append a ``Counter``
    of the group ids of the trajectories it trains to the list it returns."""
    from collections import Counter

    def install(trainer) -> list[Counter]:
        seen: list[Counter] = []
        learn = trainer._learn

        def counting_learn(rows, batch):
            trajectories = sorted(set(batch.trajectory_index.tolist()))
            seen.append(Counter(rows[t]["group_id"] for t in trajectories))
            return learn(rows, batch)

        trainer._learn = counting_learn
        return seen

    return install
