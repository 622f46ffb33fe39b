"""The EP process group's lifecycle: join (rendezvous at an address the head picks), leave.

Invariants: every rank joins with the same address, port and world size; NCCL carries the
MoE traffic on CUDA and a gloo group carries commands and results (gloo does both on CPU);
with ``EpComm`` this is the only code that calls torch.distributed.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on ``addr`` now (the head hands it to every rank)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def join_ep_group(rank: int, world_size: int, addr: str, port: int, device_type: str,
                  timeout_s: float = 120.0):
    """Join the group; returns ``(data_group, cpu_group)`` (``None`` = the default group)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return None, cpu_group


def leave_ep_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
