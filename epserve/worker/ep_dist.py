"""The EP process group's lifecycle: join (rendezvous at an address the head picks), leave.

Invariants: every rank joins with the same address, port and world size; NCCL carries the
MoE traffic on CUDA and a gloo group carries commands and results (gloo does both on CPU);
with ``EpComm`` this is the only code that calls torch.distributed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist


#: How long ranks wait for each other to join (loading a rank's shard happens before).
RENDEZVOUS_TIMEOUT_S = 600.0


def join_ep_group(rank: int, world_size: int, addr: str, port: int, device_type: str,
                  timeout_s: float = 120.0):
    """Join the group; returns ``(data_group, cpu_group)``: the MoE exchange's (NCCL on CUDA,
    gloo on CPU) and the command channel's (gloo), both with collectives that fail after
    ``timeout_s`` (the rendezvous itself may take ``RENDEZVOUS_TIMEOUT_S``).

    Rank 0 serves the rendezvous store on ``addr`` only: torch's own TCPStore server listens on
    every interface whatever its host, so it is handed a socket bound here. On a loopback
    ``addr`` gloo's pairs stay on loopback too (it otherwise binds where the hostname
    resolves)."""
    if ipaddress.ip_address(addr).is_loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    timeout = timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
    if rank == 0:
        listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen()
        store = dist.TCPStore(addr, port, world_size, True, timeout,
                              wait_for_workers=False,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    collective = timedelta(seconds=timeout_s)
    data_group = dist.new_group(backend=backend, timeout=collective)
    cpu_group = dist.new_group(backend="gloo", timeout=collective) if backend == "nccl" \
        else data_group
    return data_group, cpu_group


def _loopback_interface() -> str:
    """The loopback interface's name: ``lo`` on Linux, ``lo0`` on BSD and macOS."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def leave_ep_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
