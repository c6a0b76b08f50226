"""FSDP2 for the GRPO actor: ``fully_shard`` over a 1-D device mesh, gloo on CPU and NCCL on
GPU, ranks started with ``torch.multiprocessing`` (or already running under ``torchrun``), or as
Ray actors on several nodes (:mod:`agentloop_trainer.update.ray_ranks`). What a rank runs, and the
launch of a whole run, are in :mod:`agentloop_trainer.stages.build`; this module knows nothing of the
trainer.

Rank 0 hosts the rollout engine and does rollouts, evaluation, logging and checkpoints; every
rank holds a shard of the policy and computes the loss on its slice of the batch. After each
update the weights are gathered tensor by tensor and pushed into the engine in bounded buckets
(:mod:`agentloop_trainer.update.weights`).
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
"""The rendezvous address of ranks that all run on one machine (the default)."""


def free_port(host: str = LOOPBACK) -> int:
    """A free TCP port on ``host`` for the process-group rendezvous (the address the store will
    listen on: 127.0.0.1 for ranks on one machine, rank 0's node address for several)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rendezvous_store(rank: int, world_size: int, host: str, port: int, timeout: Any = None) -> Any:
    """The ``TCPStore`` the ranks meet at: rank 0 hosts it listening on ``host`` only, the others
    connect to it there.

    torch's own store (``init_process_group`` with ``MASTER_ADDR``) listens on every address of
    rank 0's machine whatever ``MASTER_ADDR`` says, and it is unauthenticated: anyone who can
    reach the port can write keys into the rendezvous. Rank 0 binds the socket itself and hands
    it to the store (``master_listen_fd``).

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        host: The address the store listens on and the ranks connect to.
        port: Its port.
        timeout: A ``datetime.timedelta`` (None: torch's default process-group timeout).
    """
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    timeout = default_pg_timeout if timeout is None else timeout
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)  # pyright: ignore[reportPrivateImportUsage]
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=max(128, world_size))
    # The store owns the socket from here (it closes it); Python must not close it under it.
    fd = listener.detach()
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,  # pyright: ignore[reportPrivateImportUsage]
                         wait_for_workers=False, master_listen_fd=fd, use_libuv=True)


def init_process_group(rank: int, world_size: int, port: int, device: str = "cpu", addr: str | None = None) -> None:
    """Join the default process group (gloo on CPU, NCCL on CUDA) through a
    :func:`rendezvous_store` listening on rank 0's address only.

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        port: Rendezvous port on rank 0's node.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        addr: Rank 0's address, where the store listens; None keeps ``MASTER_ADDR`` if set, else
            127.0.0.1 (ranks on one machine: nothing listens beyond loopback).
    """
    import torch
    import torch.distributed as dist

    if addr is not None:
        os.environ["MASTER_ADDR"] = addr
    os.environ.setdefault("MASTER_ADDR", LOOPBACK)
    os.environ["MASTER_PORT"] = str(port)
    # One thread per rank: with 2 cores, more threads per process were many times slower.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = rendezvous_store(rank, world_size, os.environ["MASTER_ADDR"], port)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def shard_policy(model: Any, device: str = "cpu", dtype: str = "float32", offload: bool = False,
                 layers: Any = None) -> Any:
    """``fully_shard`` each decoder layer, then the root (embeddings and the tied head).

    Args:
        model: A transformers causal LM, or a peft model over one.
        device: The mesh's device type.
        dtype: ``bfloat16``: mixed precision, with float32 shards (what the optimizer steps) and
            gradient reduction, bfloat16 gathered parameters and compute.
        offload: Keep shards, gradients and optimizer state in host memory (FSDP2
            ``CPUOffloadPolicy``; the optimizer step runs on the CPU).
        layers: The modules to shard one by one before the root; None: the decoder layers of
            ``model`` (peft unwrapped). The critic passes its trunk's (update/critic.py).

    Returns:
        The same module, now holding DTensor shards.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from agentloop_trainer.update.weights import unwrap_policy

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    kw: dict[str, Any] = {"mesh": mesh}
    if dtype != "float32":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda") if offload else OffloadPolicy()
    for layer in shard_units(unwrap_policy(model)) if layers is None else layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def shard_units(model: Any) -> list[Any]:
    """The modules FSDP2 shards one by one before the root (each gathered only while it runs):
    the decoder layers of the language model (``get_decoder().layers``: ``model.layers`` of a
    text model, ``model.language_model.layers`` or ``model.text_model.layers`` of a
    vision-language model, which sharded at the root alone gathered every weight at once).

    A vision tower stays in the root unit: a rank whose micro-batch holds no image (a text row,
    a failed sample's stand-in) never runs it, so a vision block sharded on its own would wait
    on an all-gather the other ranks never issue."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", model), "layers", [])
    return list(layers)


def is_sharded(model: Any) -> bool:
    """Whether ``model``'s parameters are FSDP2 (DTensor) shards."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def load_reference(model_path: str | Path, device: str = "cpu", dtype: str = "float32", offload: bool = False) -> Any:
    """The frozen reference policy for the KL loss, sharded like the policy (each rank holds a
    shard; a forward pass all-gathers layer by layer, so every rank must run the same number)."""
    import torch

    from agentloop_engines.adapters.hf.vision import load_model

    ref = load_model(str(model_path), torch.float32)
    ref = ref.eval().requires_grad_(False)
    # pyright's ignore: PreTrainedModel.to is typed without binding self (see policy.model).
    return shard_policy(ref if offload else ref.to(device), device, dtype, offload)  # pyright: ignore[reportArgumentType]


def full_model_state(model: Any) -> dict[str, Any]:
    """The full (unsharded) state dict on CPU; complete on rank 0, empty elsewhere. Every rank
    must call it (it is a collective). Works on a plain module too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_train_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full model and optimizer state dicts (collective; complete on rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_train_state(model: Any, optimizer: Any, model_state: dict, optim_state: dict) -> None:
    """Load full state dicts (from :func:`full_train_state`) into a possibly sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _entry(rank: int, world_size: int, port: int, device: str, fn: Callable, args: tuple, out_dir: str) -> None:
    import pickle

    import torch.distributed as dist

    init_process_group(rank, world_size, port, device)
    try:
        result = fn(rank, *args)
        if rank == 0:
            Path(out_dir, "result.pkl").write_bytes(pickle.dumps(result))
        del result
        # What fn left in reference cycles (FSDP modules, the device meshes that hold the process
        # group) is freed now, while the interpreter is alive; left to the interpreter's
        # finalization, gloo's worker threads are torn down under it (SIGABRT, "terminate called
        # without an active exception": pytorch/pytorch#179291 describes that path).
        gc.collect()
        # Every rank reaches here before any tears its group down: a rank that destroyed gloo's
        # pairs while its peer still had traffic on them died once in CI with SIGABRT
        # ("terminate called without an active exception"). Not on the error path, where the
        # peer may never arrive.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, device: str = "cpu") -> Any:
    """Run ``fn(rank, *args)`` on ``world_size`` fresh processes in one process group and
    return rank 0's result. ``fn`` must be importable (a module-level function)."""
    import pickle
    import tempfile

    from torch.multiprocessing.spawn import spawn as spawn_processes

    with tempfile.TemporaryDirectory(prefix="agentloop-fsdp-") as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        spawn_processes(_entry, args=(world_size, free_port(), device, fn, args, tmp), nprocs=world_size, join=True)
        return pickle.loads(Path(tmp, "result.pkl").read_bytes())
