"""The expert-parallel communicator: the only code that calls torch.distributed for EP traffic.

Owns MoE dispatch/combine (``all_to_all_single`` on the data group) and the command channel
(bytes over a gloo CPU group). Invariants: rank r holds experts ``[r*E/N, (r+1)*E/N)``; a token
goes at most once to each rank (with all K ids and weights; the receiver's experts ignore ids
they do not hold); every rank enters every collective in the same order, with zero rows if it
has none; nothing is pickled. ``moe_forward_ref`` beside it is the single-process definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

LocalFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MAX_CONTROL_BYTES = 64 * 2**20
# A broadcast's first frame carries the size header and up to this many payload bytes, so a
# typical step command (a few KiB) costs one collective instead of two.
INLINE_BYTES = 8192
# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch``.

    perm: [S] int64, the token index of each sent row, grouped by destination rank (rank order,
    token order within a rank); send_splits[r]: rows sent to rank r; recv_splits[r]: rows
    received from rank r; num_tokens: T of the dispatching rank."""

    perm: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


def route(topk_ids: torch.Tensor, world_size: int, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Which rows go where. topk_ids: [T, K] int64 global expert ids.

    Returns perm: [S] int64 (token index per sent row, grouped by destination rank) and
    send_splits: [N] counts. A token goes once to each distinct rank owning one of its experts."""
    per_rank = num_experts // world_size
    owner = topk_ids // per_rank  # [T, K]
    mask = torch.zeros(topk_ids.shape[0], world_size, dtype=torch.bool, device=topk_ids.device)
    mask.scatter_(1, owner, True)  # [T, N]
    dest_tok = mask.t().nonzero()  # [S, 2] (rank, token), sorted by rank then token
    send_splits = mask.sum(dim=0).tolist()
    return dest_tok[:, 1].contiguous(), send_splits


def _check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int) -> None:
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape \
            or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"dispatch: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)} must be [T, H], [T, K], [T, K]")
    if topk_ids.dtype != torch.int64:
        raise ValueError(f"dispatch: topk_ids must be int64, got {topk_ids.dtype}")
    if bool(((topk_ids < 0) | (topk_ids >= num_experts)).any()):  # one host sync
        raise ValueError(f"dispatch: expert ids must lie in [0, {num_experts})")


class EpComm:
    """One rank's EP communicator. group: data group for all_to_all (NCCL on CUDA, gloo on CPU;
    None = default); cpu_group: gloo group for the control channel (None = default)."""

    def __init__(self, rank: int, world_size: int, num_experts: int, group=None, cpu_group=None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"EpComm: need 0 <= rank < world_size, got {rank}, {world_size}")
        if num_experts % world_size:
            raise ValueError(f"EpComm: num_experts={num_experts} not divisible by "
                             f"world_size={world_size}")
        if dist.is_initialized():
            for g in (group, cpu_group):
                if dist.get_rank(g) != rank or dist.get_world_size(g) != world_size:
                    raise ValueError(f"EpComm: rank {rank}/{world_size} does not match group "
                                     f"rank {dist.get_rank(g)}/{dist.get_world_size(g)}")
        self.rank, self.world_size, self.num_experts = rank, world_size, num_experts
        self.group, self.cpu_group = group, cpu_group

    # ------------------------------------------------------------------ dispatch / combine

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token to the ranks owning its experts.

        x: [T, H]; topk_ids: [T, K] int64 global ids; topk_weights: [T, K] float32.
        Returns x_recv: [R, H] x.dtype, ids_recv: [R, K] int64, w_recv: [R, K] float32 (rows
        grouped by source rank) and the handle for ``combine``."""
        _check_inputs(x, topk_ids, topk_weights, self.num_experts)
        k = topk_ids.shape[1]
        perm, send_splits = route(topk_ids, self.world_size, self.num_experts)
        counts = torch.tensor(send_splits, dtype=torch.int64, device=x.device)  # [N]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_splits = recv_counts.tolist()
        r = sum(recv_splits)
        x_recv = x.new_empty((r, x.shape[1]))
        dist.all_to_all_single(x_recv, x[perm].contiguous(), recv_splits, send_splits,
                               group=self.group)
        # ids (int32: expert ids are small) and the float32 weights' bits travel as one tensor.
        meta = torch.cat([topk_ids[perm].to(torch.int32),
                          topk_weights[perm].float().view(torch.int32)], dim=1)  # [S, 2K]
        meta_recv = meta.new_empty((r, 2 * k))
        dist.all_to_all_single(meta_recv, meta, recv_splits, send_splits, group=self.group)
        ids_recv = meta_recv[:, :k].to(torch.int64)
        w_recv = meta_recv[:, k:].contiguous().view(torch.float32)
        return x_recv, ids_recv, w_recv, DispatchHandle(perm, send_splits, recv_splits,
                                                        x.shape[0])

    def combine(self, y_recv: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send partial results back and sum them per token.

        y_recv: [R, H], row i the partial output for ``dispatch``'s x_recv row i.
        Returns [T, H] y_recv.dtype (summed in float32)."""
        if y_recv.shape[0] != sum(handle.recv_splits):
            raise ValueError(f"combine: y_recv has {y_recv.shape[0]} rows, dispatch received "
                             f"{sum(handle.recv_splits)}")
        y_back = y_recv.new_empty((handle.perm.shape[0], y_recv.shape[1]))
        dist.all_to_all_single(y_back, y_recv.contiguous(), handle.send_splits,
                               handle.recv_splits, group=self.group)
        out = torch.zeros((handle.num_tokens, y_recv.shape[1]), dtype=torch.float32,
                          device=y_recv.device)
        out.index_add_(0, handle.perm, y_back.float())
        return out.to(y_recv.dtype)

    def moe_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    local_fn: LocalFn) -> torch.Tensor:
        """dispatch -> local_fn(x_recv, ids_recv, w_recv) -> combine. x: [T, H]; returns [T, H]."""
        x_recv, ids_recv, w_recv, handle = self.dispatch(x, topk_ids, topk_weights)
        y = local_fn(x_recv, ids_recv, w_recv) if x_recv.shape[0] else x_recv
        return self.combine(y.to(x.dtype), handle)

    # ------------------------------------------------------------------ control channel

    def broadcast_bytes(self, data: bytes | None, src: int = 0,
                        max_bytes: int = MAX_CONTROL_BYTES) -> bytes:
        """``src``'s bytes on every rank (src passes them, the others None).

        One frame: [8-byte size | first INLINE_BYTES of payload]; the rest, if any, follows in a
        second broadcast. ``ValueError`` on src before anything is sent if the payload exceeds
        ``max_bytes``; a receiver that reads a size above its ``max_bytes`` raises ValueError
        (the channel is broken: the caller must exit)."""
        frame = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
        if self.rank == src:
            if data is None or len(data) > max_bytes:
                raise ValueError(f"broadcast_bytes: payload of "
                                 f"{None if data is None else len(data)} bytes, max {max_bytes}")
            n = len(data)
            frame[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            head = min(n, INLINE_BYTES)
            if head:
                frame[8:8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        dist.broadcast(frame, group=self.cpu_group, group_src=src)
        n = int(frame[:8].view(torch.int64)[0])
        if not 0 <= n <= max_bytes:
            raise ValueError(f"broadcast_bytes: received size {n} outside [0, {max_bytes}]: "
                             "command channel broken")
        if n <= INLINE_BYTES:
            return frame[8:8 + n].numpy().tobytes()
        if self.rank == src:
            rest = torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
        else:
            rest = torch.empty(n - INLINE_BYTES, dtype=torch.uint8)
        dist.broadcast(rest, group=self.cpu_group, group_src=src)
        return data if self.rank == src else frame[8:].numpy().tobytes() + rest.numpy().tobytes()

    def gather_bytes(self, data: bytes, dst: int = 0,
                     max_bytes: int = MAX_CONTROL_BYTES) -> list[bytes] | None:
        """Every rank's bytes on ``dst`` in rank order; None on the others.

        Sizes first (all_gather, so every rank sees them), then payloads padded to the largest.
        If any size exceeds ``max_bytes`` every rank raises ValueError before the payloads."""
        sizes = torch.empty(self.world_size, dtype=torch.int64)
        _all_gather_single(sizes, torch.tensor([len(data)], dtype=torch.int64),
                           group=self.cpu_group)
        sizes_l = sizes.tolist()
        if max(sizes_l) > max_bytes:
            raise ValueError(f"gather_bytes: sizes {sizes_l} exceed max {max_bytes}")
        width = max(sizes_l)
        if width == 0:
            return [b""] * self.world_size if self.rank == dst else None
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)] \
            if self.rank == dst else None
        dist.gather(mine, bufs, group=self.cpu_group, group_dst=dst)
        if self.rank != dst:
            return None
        return [b[:s].numpy().tobytes() for b, s in zip(bufs, sizes_l)]

    def all_agree(self, ok: bool) -> bool:
        """True on every rank iff every rank passed True (an all_reduce MIN on the CPU group)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())


# ---------------------------------------------------------------------- single-process reference


def dispatch_ref(xs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor],
                 weights: Sequence[torch.Tensor], num_experts: int
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[DispatchHandle]]:
    """``EpComm.dispatch`` for N = len(xs) simulated ranks: per rank (x_recv [R, H],
    ids_recv [R, K] int64, w_recv [R, K] float32) and its handle."""
    n = len(xs)
    routes = [route(i, n, num_experts) for i in ids]
    chunks = []  # chunks[s][d]: (x, ids, w) rank s sends to rank d
    for x, i, w, (perm, splits) in zip(xs, ids, weights, routes):
        parts = zip(*(t[perm].split(splits) for t in (x, i, w.float())))
        chunks.append(list(parts))
    recv, handles = [], []
    for d in range(n):
        got = [chunks[s][d] for s in range(n)]
        recv.append(tuple(torch.cat(c) for c in zip(*got)))
        handles.append(DispatchHandle(routes[d][0], routes[d][1],
                                      [routes[s][1][d] for s in range(n)], xs[d].shape[0]))
    return recv, handles


def combine_ref(ys: Sequence[torch.Tensor], handles: Sequence[DispatchHandle]) -> list[torch.Tensor]:
    """``EpComm.combine`` for N simulated ranks. ys[d]: [R_d, H]. Returns per rank [T, H]."""
    n = len(ys)
    back = [ys[d].split(handles[d].recv_splits) for d in range(n)]  # back[d][s]: to rank s
    outs = []
    for s, h in enumerate(handles):
        y_back = torch.cat([back[d][s] for d in range(n)])  # [S, H], grouped by owner rank
        out = torch.zeros((h.num_tokens, ys[s].shape[1]), dtype=torch.float32)
        out.index_add_(0, h.perm, y_back.float())
        outs.append(out.to(ys[s].dtype))
    return outs


def moe_forward_ref(xs: list[torch.Tensor], ids: list[torch.Tensor], weights: list[torch.Tensor],
                    local_fns: list[LocalFn], num_experts: int) -> list[torch.Tensor]:
    """``EpComm.moe_forward`` on N = len(xs) ranks simulated in one process.

    xs[r]: [T_r, H]; ids[r]: [T_r, K] int64; weights[r]: [T_r, K] float32; local_fns[r]: rank
    r's experts. Returns per rank [T_r, H]."""
    recv, handles = dispatch_ref(xs, ids, weights, num_experts)
    ys = [fn(*r).to(r[0].dtype) for fn, r in zip(local_fns, recv)]
    return combine_ref(ys, handles)
