"""EP step costs: the command round (encode, broadcast, decode, validate) and MoE dispatch/combine.

    python bench/ep_step.py                                          # CPU, gloo, EP=2, fp32
    python bench/ep_step.py --device cuda --backend nccl --world 8   # one GPU per rank, bf16

Spawns ``--world`` processes on 127.0.0.1; rank 0 prints. How it measures:

* Command round (always on the gloo CPU group, as in serving): one ``StepCommand`` with 256
  decode rows (both ranks, mostly ``FEED_DEVICE``) and 2 block updates, step id rising each round,
  against an ``EpMirror`` holding the 256 sequences. Every round starts at a barrier (an
  ``all_agree``). Leader: ``encode`` and ``encode + broadcast_bytes`` on its clock. Rank 1:
  ``decode`` and ``EpMirror.validate`` on its clock. One way = rank 1's end of validate minus
  the leader's start of encode (same-host ``CLOCK_MONOTONIC``). Round trip, on the leader's
  clock: encode + broadcast, rank 1 decode + validate, then a 1-byte reply broadcast from rank 1.
* Dispatch/combine: random top-K routing over E experts, T tokens per rank; each call between
  barriers (and ``cuda.synchronize`` on GPU); the median per rank, the slowest rank reported.
  Bandwidth counts bytes this rank sends to and receives from the other ranks (rows to or from
  itself are a local copy): hidden states, plus ids and weights on dispatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from epserve.models.traits import RowSampling
from epserve.worker.ep_comm import EpComm
from epserve.worker.step_command import (FEED_DEVICE, BlockUpdate, DecodeRow, NewSeq,
                                     StepCommand, decode, encode)

NUM_SEQS, BLOCK_SIZE, PROMPT_LEN, VOCAB = 256, 16, 100, 151_936


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _make_mirror(world: int):
    """An EpMirror with the 256 sequences live (step 0 applied), or (None, why not)."""
    try:
        from epserve.worker.ep_mirror import EpMirror
    except ImportError as exc:
        return None, f"validate not measured (no epserve.worker.ep_mirror: {exc})"
    known = dict(world_size=world, num_blocks=NUM_SEQS * 64, block_size=BLOCK_SIZE,
                 max_slots=NUM_SEQS, max_blocks_per_seq=64, vocab_size=VOCAB)
    try:
        params = inspect.signature(EpMirror).parameters
        mirror = EpMirror(**{k: known[k] for k in params})
        samp = RowSampling(0.7, 0.95, 50, 0.0, 1234, (), None)
        seqs = [(i % world, i // world) for i in range(NUM_SEQS)]
        first = StepCommand(
            step_id=0, new_seqs=tuple(NewSeq(r, s, PROMPT_LEN, PROMPT_LEN, -1, samp)
                                      for r, s in seqs),
            block_updates=tuple(BlockUpdate(r, s, 0, tuple(range(8 * i, 8 * i + 8)))
                                for i, (r, s) in enumerate(seqs)))
        mirror.validate(first)
        mirror.apply(first)
        return mirror, ""
    except Exception as exc:  # API drift: measure the rest, say so
        return None, f"validate not measured (EpMirror setup failed: {type(exc).__name__}: {exc})"


def _step_command(world: int) -> StepCommand:
    """Step 1's command: 256 decode rows, every 8th with an explicit token, 2 block updates."""
    rows = tuple(DecodeRow(i % world, i // world, FEED_DEVICE if i % 8 else 1000 + i, i)
                 for i in range(NUM_SEQS))
    blocks = (BlockUpdate(0, 0, 8, (NUM_SEQS * 8,)), BlockUpdate(1 % world, 1, 8, (NUM_SEQS * 8 + 1,)))
    return StepCommand(step_id=1, decode=rows, block_updates=blocks)


def command_round(comm: EpComm, rank: int, world: int, rounds: int) -> dict | None:
    mirror, note = _make_mirror(world)
    base = _step_command(world)
    cmds = [dataclasses.replace(base, step_id=i + 1) for i in range(rounds + 20)]
    lead: dict[str, list[float]] = {"encode": [], "encode+broadcast": [], "round trip": []}
    work: dict[str, list[float]] = {"decode": [], "validate": []}
    starts, ends = [], []
    for cmd in cmds:
        comm.all_agree(True)  # barrier
        if rank == 0:
            t0 = time.perf_counter_ns()
            frame = encode(cmd)
            t1 = time.perf_counter_ns()
            comm.broadcast_bytes(frame, src=0)
            t2 = time.perf_counter_ns()
            comm.broadcast_bytes(None, src=min(1, world - 1))
            t3 = time.perf_counter_ns()
            starts.append(t0)
            for k, v in zip(lead, (t1 - t0, t2 - t0, t3 - t0)):
                lead[k].append(v / 1e3)
        else:
            frame = comm.broadcast_bytes(None, src=0)
            t0 = time.perf_counter_ns()
            got = decode(frame)
            t1 = time.perf_counter_ns()
            if mirror is not None:
                mirror.validate(got)
            t2 = time.perf_counter_ns()
            ends.append(t2)
            work["decode"].append((t1 - t0) / 1e3)
            work["validate"].append((t2 - t1) / 1e3)
            comm.broadcast_bytes(b"\x01" if rank == 1 else None, src=1)
    start_bytes = comm.broadcast_bytes(struct.pack(f"{len(starts)}q", *starts) if rank == 0
                                       else None, src=0)
    stats = {}
    if rank == 1:
        t_lead = struct.unpack(f"{len(start_bytes) // 8}q", start_bytes)
        work["one way (leader encode -> worker validated)"] = [
            (e - s) / 1e3 for s, e in zip(t_lead, ends)]
        stats = {k: v[20:] for k, v in work.items()}  # drop warm-up rounds
    got = comm.gather_bytes(json.dumps(stats).encode(), dst=0)
    if rank != 0:
        return None
    merged = {k: v[20:] for k, v in lead.items()}
    for part in got[1:2]:
        merged.update(json.loads(part))
    return dict(stats=merged, note=note, frame_bytes=len(encode(base)), rows=len(base.decode))


def dispatch_combine(comm: EpComm, rank: int, world: int, tokens: int, args, device, dtype
                     ) -> dict | None:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, args.hidden, generator=g).to(device, dtype)
    ids = torch.rand(tokens, args.experts, generator=g).topk(args.topk, dim=1).indices.to(device)
    w = torch.rand(tokens, args.topk, generator=g).to(device)
    iters = args.iters or (50 if device.type == "cuda" else (40 if tokens <= 512 else 8))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        comm.all_agree(True)

    times = {"dispatch": [], "combine": []}
    for i in range(iters + 2):
        sync()
        t0 = time.perf_counter()
        x_recv, ids_recv, w_recv, h = comm.dispatch(x, ids, w)
        sync_dev = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync_dev()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        comm.combine(x_recv, h)
        sync_dev()
        t3 = time.perf_counter()
        if i >= 2:
            times["dispatch"].append(t1 - t0)
            times["combine"].append(t3 - t2)
    remote_rows = (sum(h.send_splits) - h.send_splits[rank]) + (sum(h.recv_splits) - h.recv_splits[rank])
    row = args.hidden * x.element_size()
    mine = {k: statistics.median(v) for k, v in times.items()}
    mine["bytes_dispatch"] = remote_rows * (row + 2 * args.topk * 4)
    mine["bytes_combine"] = remote_rows * row
    got = comm.gather_bytes(json.dumps(mine).encode(), dst=0)
    if rank != 0:
        return None
    per_rank = [json.loads(b) for b in got]
    slow = max(per_rank, key=lambda r: r["dispatch"] + r["combine"])
    return dict(tokens=tokens, **slow)


def _rank_main(rank: int, world: int, port: int, args, q) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    try:
        init = f"tcp://127.0.0.1:{port}"
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(args.backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        cpu_group = dist.new_group(backend="gloo") if args.backend != "gloo" else None
        comm = EpComm(rank, world, args.experts, group=None, cpu_group=cpu_group)
        device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        res = {"command": command_round(comm, rank, world, args.rounds),
               "moe": [dispatch_combine(comm, rank, world, t, args, device, dtype)
                       for t in args.tokens]}
        if rank == 0:
            q.put(("ok", res))
        dist.destroy_process_group()
    except BaseException as exc:
        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def _report(res: dict, args) -> None:
    cmd = res["command"]
    print(f"command: {cmd['rows']} decode rows + 2 block updates, frame {cmd['frame_bytes']} "
          f"bytes, {len(cmd['stats']['encode'])} rounds")
    if cmd["note"]:
        print(f"NOTE: {cmd['note']}")
    dt = "bf16" if args.device == "cuda" else "fp32"
    print(f"\n### Command round (EP={args.world}, gloo CPU group, loopback), microseconds\n")
    print("| measure | median us | p90 us |\n|---|---:|---:|")
    for k, v in cmd["stats"].items():
        print(f"| {k} | {statistics.median(v):.1f} | {_pct(v, 0.9):.1f} |")
    print(f"\n### Dispatch / combine (EP={args.world}, {args.backend}, {args.device}, {dt}, "
          f"H={args.hidden}, top-{args.topk}, E={args.experts}), slowest rank's median\n")
    print("| tokens/rank | dispatch ms | combine ms | dispatch GB/s | combine GB/s |\n"
          "|---:|---:|---:|---:|---:|")
    for m in res["moe"]:
        print(f"| {m['tokens']} | {m['dispatch'] * 1e3:.3f} | {m['combine'] * 1e3:.3f} | "
              f"{m['bytes_dispatch'] / m['dispatch'] / 1e9:.2f} | "
              f"{m['bytes_combine'] / m['combine'] / 1e9:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[128, 4096])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--iters", type=int, default=0, help="dispatch/combine calls (0: auto)")
    args = ap.parse_args()
    if args.world < 2 or args.experts % args.world:
        ap.error("--world must be >= 2 and divide --experts")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    status, res = q.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    if status != "ok":
        print(res, file=sys.stderr)
        return 1
    _report(res, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
