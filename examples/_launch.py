"""Start an example on N ranks: under ``torchrun`` use its environment, otherwise spawn the ranks here.

``launch(fn, world_size, *args)`` calls ``fn(*args)`` on every rank after ``init_process_group`` (gloo on CPU;
NCCL when at least ``world_size`` GPUs are visible, one per rank) and destroys the group afterwards.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["launch", "pick_backend", "rank_device"]


def pick_backend(world_size: int, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def rank_device(backend: str) -> torch.device:
    """This rank's device: its GPU under NCCL (LOCAL_RANK), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    return torch.device("cuda", local)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, backend: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        kwargs["device_id"] = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120), **kwargs)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto") -> None:
    """Run ``fn(*args)`` on ``world_size`` ranks (``fn`` must be a module-level function)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        world = int(os.environ["WORLD_SIZE"])
        _rank_main(int(os.environ["RANK"]), world, pick_backend(world, backend), fn, args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(
        _rank_main, args=(world_size, pick_backend(world_size, backend), fn, args), nprocs=world_size, join=True
    )


def print_rank_reports(lines: list) -> None:
    """Gather every rank's report lines (collective) and print them on rank 0, rank by rank."""
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, lines)
    if dist.get_rank() == 0:
        for r, rl in enumerate(reports):
            print(f"rank {r}:")
            print("\n".join(rl))
