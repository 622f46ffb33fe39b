"""Sweep the fused MoE tiles on one GPU at the Qwen3-30B-A3B layer shape; prints a table last.

For each token count T it times ``fused_moe_triton`` with the default tiles and with each
candidate (CUDA events, median of several runs, kernel launches only: no host work in the
loop), and reports the effective weight bandwidth: bytes of the experts the routing touches
(3 * H * I * 2 bytes each) / time.

    python bench/moe_tiles.py [--tokens 1 8 32 128 256 1024 4096] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from epserve.kernels.fused_moe_triton import MoeTiles, default_tiles, fused_moe_triton

H, I, E, K = 2048, 768, 128, 8


def _time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[len(times) // 2]


def candidates(quick: bool) -> list[dict]:
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
            (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
        if quick and stages == 4:
            continue
        out.append(dict(block_m=bm, block_n1=bn, block_k1=bk, block_n2=bn, block_k2=bk,
                        num_warps=warps, num_stages=stages))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 256, 1024, 4096])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
        probs = torch.softmax(torch.randn(t, E, device="cuda", generator=g), -1)
        wts, ids = torch.topk(probs, K, dim=-1)
        wts = (wts / wts.sum(-1, keepdim=True)).float()
        touched = int(torch.unique(ids).numel())
        gbytes = touched * 3 * H * I * 2 / 1e9
        base = default_tiles(t * K, E, H, I)
        base_ms = _time_ms(lambda: fused_moe_triton(x, w13, w2, ids, wts, tiles=base))
        best, best_ms = base, base_ms
        for c in candidates(args.quick):
            tiles = MoeTiles(**c)
            try:
                ms = _time_ms(lambda: fused_moe_triton(x, w13, w2, ids, wts, tiles=tiles), 10)
            except Exception as exc:  # out of shared memory etc.: not a candidate
                print(f"T={t} {c}: {type(exc).__name__}", file=sys.stderr)
                continue
            if ms < best_ms:
                best, best_ms = tiles, ms
        rows.append((t, touched, base_ms, gbytes / base_ms * 1e3, best_ms,
                     gbytes / best_ms * 1e3, best))
        print(f"T={t}: default {base_ms:.3f} ms, best {best_ms:.3f} ms {best}", flush=True)
    print("\n| T | experts hit | default ms | GB/s | best ms | GB/s | best tiles |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for t, hit, bms, bgb, ms, gb, tiles in rows:
        desc = (f"m{tiles.block_m} n{tiles.block_n1} k{tiles.block_k1} "
                f"w{tiles.num_warps} s{tiles.num_stages}")
        print(f"| {t} | {hit} | {bms:.3f} | {bgb:.0f} | {ms:.3f} | {gb:.0f} | {desc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
