"""Sweep the fused MoE tiles on one GPU at the Qwen3-30B-A3B layer shape; prints a table last.

For each token count T it times ``fused_moe_triton`` (align, both GEMMs, combine) with the
default tiles, then searches one coordinate at a time: ``block_m``, then GEMM 1's tile and
launch shape (n, k, warps, stages), then GEMM 2's. Up to ``ALIGN_IN_KERNEL_MAX_PAIRS`` pairs
(decode; the engine replays these in CUDA graphs) the call is captured in a CUDA graph and
timed by replays, so launch cost from Python is left out; above (prefill, eager in the engine)
it is timed eagerly. Reports the effective weight bandwidth (bytes of the experts the routing
touches, 3 * H * I * 2 each, / time) and, for large T, TFLOP/s.

Every timed call routes to other experts than the call before (16 routings, each the first
shifted by 8 experts, replayed in turn): in the model each layer's experts are cold in L2 (the
layers between stream ~100 MB through it), and one routing replayed again and again would read
part of its 75 MB from the 50 MB L2 instead (session 3's T=1 figure, 28 us, was that).

    python bench/moe_tiles.py [--tokens 1 256 8192] [--wide] [--gemm 1 2] [--rounds 2] [--parts]

``--tiles "m128|n128 k64 w8 s4|n256 k64 w8 s4" ...`` times just those tiles (the table's own
format, spaces or ``|`` between fields) beside the defaults, no search: a few candidates in
seconds rather than a search's minutes of compiles.
``--rounds 2`` runs the coordinate search twice (block_m again after the GEMMs' tiles moved);
``--parts`` prints, for the best tiles at each T, the GPU time of each kernel of one call (the
layout's torch ops, GEMM 1, GEMM 2, the combine) from the torch profiler, with each GEMM's
TFLOP/s: which part a faster MoE must come from.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from dataclasses import replace

import torch

from epserve.kernels.triton.fused_moe import (ALIGN_IN_KERNEL_MAX_PAIRS, MoeTiles, default_tiles,
                                              fused_moe_triton)

H, I, E, K = 2048, 768, 128, 8
ROUTINGS = 16


def _events_ms(fn, iters: int) -> float:
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


def time_ms(fn, graph: bool, iters: int = 20) -> float:
    """Median ms per call: CUDA-graph replays (``graph``) or eager calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    if not graph:
        return _events_ms(fn, iters)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    return _events_ms(g.replay, iters)


def parts(call, flop1: int, flop2: int) -> str:
    """GPU ms of each kernel of one ``call`` (profiled, median of 5 calls), in launch order; the
    two GEMM launches with their TFLOP/s (``flop1``, ``flop2``)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    per_call: list[list[tuple[str, float]]] = []
    for _ in range(5):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
        per_call.append([(e.name, e.time_range.elapsed_us() / 1e3) for e in evs])
    n = min(len(c) for c in per_call)
    out, gemm = [], 0
    for i in range(n):
        name = per_call[0][i][0]
        ms = sorted(c[i][1] for c in per_call)[2]
        label = name.split("(")[0][:40]
        if "_moe_gemm_kernel" in name:
            gemm += 1
            flop = flop1 if gemm == 1 else flop2
            label = f"GEMM {gemm} {ms:.4f} ms ({flop / ms / 1e9:.0f} TFLOP/s)"
            out.append(label)
        else:
            out.append(f"{label} {ms:.4f}")
    return "; ".join(out)


def parse_tiles(text: str) -> MoeTiles:
    """``MoeTiles.describe()``'s format back: ``m | n k w s | n k w s``."""
    f = re.findall(r"([mnkws])(\d+)", text)
    want = "mnkwsnkws"
    if "".join(c for c, _ in f) != want:
        raise argparse.ArgumentTypeError(f"tiles {text!r}: want m | n k w s | n k w s")
    v = [int(n) for _, n in f]
    return MoeTiles(block_m=v[0], block_n1=v[1], block_k1=v[2], warps1=v[3], stages1=v[4],
                    block_n2=v[5], block_k2=v[6], warps2=v[7], stages2=v[8])


def gemm_space(t: int, wide: bool) -> list[tuple[int, int, int, int]]:
    """(n, k, warps, stages) candidates for one GEMM at T tokens (``wide``: a larger grid)."""
    if t <= 16:  # weight streaming: narrow tiles, deep K
        ns, ks, stages = (16, 32, 64), (128, 256), (3, 4, 6)
    elif t <= 256:
        ns, ks, stages = (64, 128, 256), (64, 128), (2, 3, 4)
    else:
        ns, ks, stages = (64, 128, 256), (32, 64), (3, 4)
    if wide:
        ns, ks, stages = (16, 32, 64, 128, 256), (32, 64, 128, 256), (2, 3, 4, 5)
    return list(itertools.product(ns, ks, (4, 8), stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    ap.add_argument("--wide", action="store_true", help="search more candidates per GEMM")
    ap.add_argument("--gemm", nargs="+", default=["1", "2"], choices=["1", "2"],
                    help="which GEMMs' tiles to search")
    ap.add_argument("--rounds", type=int, default=1, help="coordinate-search passes")
    ap.add_argument("--tiles", type=parse_tiles, nargs="+", default=None, metavar="TILES",
                    help="time these tiles beside the defaults instead of searching")
    ap.add_argument("--parts", action="store_true",
                    help="per-kernel GPU time of one call with the best tiles (profiler)")
    args = ap.parse_args(argv)
    if args.tiles and (args.rounds != 1 or args.wide or args.gemm != ["1", "2"]):
        ap.error("--tiles times the tiles given: --rounds, --wide and --gemm shape a search")
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
        probs = torch.softmax(torch.randn(t, E, device="cuda", generator=g), -1)
        wts, ids = torch.topk(probs, K, dim=-1)
        wts = (wts / wts.sum(-1, keepdim=True)).float()
        # each call other experts (when one call touches few: above, every call touches all)
        routings = [(ids + 8 * r) % E for r in range(ROUTINGS if t * K <= 128 else 1)]
        touched = int(torch.unique(ids).numel())
        gbytes = touched * 3 * H * I * 2 / 1e9
        tflop = t * K * 3 * H * I * 2 / 1e12
        graph = t * K <= ALIGN_IN_KERNEL_MAX_PAIRS

        def timed(tiles: MoeTiles) -> float:
            try:
                def calls():
                    for r in routings:
                        fused_moe_triton(x, w13, w2, r, wts, tiles=tiles)
                return time_ms(calls, graph) / len(routings)
            except Exception as exc:  # out of shared memory etc.: not a candidate
                print(f"T={t} {tiles.describe()}: {type(exc).__name__}", file=sys.stderr)
                return float("inf")

        base = default_tiles(t * K, E, H, I)
        base_ms = best_ms = timed(base)
        best = base
        tried = 1
        bms = (16, 32, 64) if t <= 256 else (64, 128)
        if args.tiles:
            want = fused_moe_triton(x, w13, w2, routings[0], wts, tiles=base).float()
        for cand in args.tiles or []:  # the candidates given, no search; same output checked
            ms, tried = timed(cand), tried + 1
            if ms < float("inf"):
                got = fused_moe_triton(x, w13, w2, routings[0], wts, tiles=cand).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:  # bf16 rounding of other summation orders is far below
                    print(f"T={t} {cand.describe()}: WRONG (max error {err:.3g} of the "
                          f"largest output)", flush=True)
                    continue
            print(f"T={t} {cand.describe()}: {ms:.4f} ms", flush=True)
            if ms < best_ms:
                best, best_ms = cand, ms
        for _ in range(0 if args.tiles else args.rounds):
            for bm in bms:  # coordinate 1: block_m
                cand = replace(best, block_m=bm)
                ms, tried = timed(cand), tried + 1
                if ms < best_ms:
                    best, best_ms = cand, ms
            for gemm in args.gemm:  # coordinates 2 and 3: each GEMM's tile and launch shape
                for n, k, w, s in gemm_space(t, args.wide):
                    cand = replace(best, **{f"block_n{gemm}": n, f"block_k{gemm}": k,
                                            f"warps{gemm}": w, f"stages{gemm}": s})
                    ms, tried = timed(cand), tried + 1
                    if ms < best_ms:
                        best, best_ms = cand, ms
        if args.parts:
            print(f"T={t} parts ({best.describe()}): " + parts(
                lambda: fused_moe_triton(x, w13, w2, routings[0], wts, tiles=best),
                t * K * H * 2 * I * 2, t * K * I * H * 2), flush=True)
        rows.append((t, touched, graph, base, base_ms, best, best_ms, gbytes, tflop))
        print(f"T={t}: default {base_ms:.4f} ms ({base.describe()}), best {best_ms:.4f} ms "
              f"({best.describe()}), {tried} tried", flush=True)
    print("\nfused_moe_triton, Qwen3-30B-A3B layer (H 2048, I 768, 128 experts, top-8), bf16; "
          "tiles: m | GEMM1 n k warps stages | GEMM2 n k warps stages")
    print("| T | experts hit | timed | default ms | best ms | GB/s | TFLOP/s | default tiles "
          "| best tiles |")
    print("|---:|---:|---|---:|---:|---:|---:|---|---|")
    for t, hit, graph, base, bms_, best, ms, gb, tf in rows:
        print(f"| {t} | {hit} | {'graph' if graph else 'eager'} | {bms_:.4f} | {ms:.4f} | "
              f"{gb / ms * 1e3:.0f} | {tf / ms * 1e3:.0f} | {base.describe()} | "
              f"{best.describe()} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
