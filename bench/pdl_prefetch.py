"""Would a GEMV gain from loading its weights before it waits on the previous kernel?

With programmatic dependent launch (``epserve/kernels/triton/pdl.py``) a kernel's programs
start while the kernel before it finishes, then wait (``gdc_wait``) before touching anything
that kernel writes. A projection's weights are never written by a step, so a GEMV could load
its first weight tiles before the wait and start streaming while the previous kernel ends
(CUTLASS's weight-prefetch example does this). This measures it before any production kernel
changes: a CUDA graph of ``--pairs`` (norm -> GEMV) pairs, the norm our ``rms_norm`` entry and
the GEMV a bench-local copy of ``kernels/triton/linear.py``'s that loads ``PRE`` tiles of each
weight row before its wait, graph-timed, for: PDL off; PDL on (production's order); PDL on with
one tile (``BLOCK_K`` wide) loaded ahead; PDL on with the whole row loaded ahead (``BLOCK_K =
K``). Then the LM head at one row: cuBLAS (``nn.Linear``) against our GEMV, which it does not
use today. Prints a table last.

    python bench/pdl_prefetch.py [--shapes 12288x2048 2048x4096] [--pairs 40]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_ahead_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr,
                       PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PRE:  # the first tile of the weight rows: no kernel of the step writes them
        w0 = tl.load(w_rows + cols[None, :], mask=r_ok[:, None] & (cols < K)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PRE:
        x0 = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        c = k0 + cols
        w = tl.load(w_rows + c[None, :], mask=r_ok[:, None] & (c < K)[None, :], other=0.0)
        xv = tl.load(x_ptr + c, mask=c < K, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=r_ok)


def gemv(x, w, out, pdl: bool, pre: int, block_k: int, block_n: int, warps: int, stages: int):
    n, k = w.shape
    _gemv_ahead_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, n, w.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k, PRE=pre, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, num_stages=stages)


def graph_us(fn, iters: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["12288x2048", "2048x4096", "1024x2048"],
                    help="N x K of the GEMVs (in_proj-, out_proj- and expert-sized)")
    ap.add_argument("--pairs", type=int, default=40, help="norm -> GEMV pairs a graph")
    ap.add_argument("--lm-heads", type=int, nargs="*", default=[151936, 248320],
                    help="vocab sizes of the LM-head comparison (Qwen3, Qwen3.5)")
    args = ap.parse_args(argv)
    from epserve.kernels.linear import linear_ref
    from epserve.kernels.triton import pdl as pdl_mod
    from epserve.kernels.triton.linear import default_gemv_tiles, linear_gemv_triton
    from epserve.kernels.triton.norm import rms_norm_triton

    rows = []
    for spec in args.shapes:
        n, k = map(int, spec.split("x"))
        bn, bk, nw, ns = default_gemv_tiles(n, k, 2)
        g = torch.Generator(device="cuda").manual_seed(n + k)
        xs = [torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(args.pairs)]
        ws = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * k ** -0.5
              for _ in range(args.pairs)]  # a weight a pair: each read from HBM, as in a step
        nwt = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(args.pairs)]
        variants = {"PDL off": (False, 0, bk), "PDL on": (True, 0, bk),
                    "PDL on, a tile ahead": (True, 1, bk)}
        if bn * k <= 4 * 2048:  # the whole row ahead fits the registers (a [4, 2048] tile)
            variants["PDL on, the row ahead"] = (True, 1, k)
        for name, (on, pre, block_k) in variants.items():
            os.environ["EPSERVE_PDL"] = "1" if on else "0"  # the norm's launches too
            pdl_mod.pdl_device.cache_clear()

            def chain():
                for x, w, o in zip(xs, ws, outs):
                    gemv(rms_norm_triton(x, nwt, 1e-6), w, o, on, pre, block_k, bn, nw, ns)

            chain()
            want = linear_ref(rms_norm_triton(xs[0], nwt, 1e-6), ws[0])
            err = (outs[0].float() - want.float()).abs().max().item()
            assert err < 0.05, f"{spec} {name}: max error {err}"
            rows.append((spec, name, graph_us(chain) / args.pairs, err))
    os.environ.pop("EPSERVE_PDL", None)
    pdl_mod.pdl_device.cache_clear()
    heads = []  # the LM head: cuBLAS (what nn.Linear runs) against our one-row GEMV
    for v in args.lm_heads:
        w = torch.randn(v, 2048, device="cuda", dtype=torch.bfloat16) * 2048 ** -0.5
        x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
        cublas = graph_us(lambda: torch.nn.functional.linear(x, w), iters=20)
        ours = graph_us(lambda: linear_gemv_triton(x, w), iters=20)
        err = (linear_gemv_triton(x, w).float() - linear_ref(x, w).float()).abs().max().item()
        heads.append((v, cublas, ours, w.numel() * 2 / 1e3, err))
    print(f"\n{torch.cuda.get_device_name()}: the LM head at one row ([1, 2048] x [V, 2048] bf16)")
    print("| V | cuBLAS us (TB/s) | our GEMV us (TB/s) | max abs error |")
    print("|---:|---:|---:|---:|")
    for v, cb, ours, kb, err in heads:
        print(f"| {v} | {cb:.1f} ({kb / cb / 1e3:.2f}) | {ours:.1f} ({kb / ours / 1e3:.2f}) "
              f"| {err:.1e} |")
    print(f"\n{torch.cuda.get_device_name()}: us per (norm -> GEMV) pair, graph of {args.pairs}")
    print("| N x K | variant | us per pair | max abs error vs reference |")
    print("|---|---|---:|---:|")
    for spec, name, us, err in rows:
        print(f"| {spec} | {name} | {us:.2f} | {err:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
