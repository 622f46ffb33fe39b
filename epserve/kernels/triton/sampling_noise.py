"""Triton Gumbel-max sampling: scale, ban, keep-set, counter-based noise and argmax in one pass.

Same contract as ``epserve.kernels.sampling_noise.gumbel_argmax_ref`` (the definition, with the
noise hash): the kernel's hash bits equal the reference's exactly (uint32 wrapping arithmetic vs
masked int64), the Gumbel transform runs in float64 like the reference, and the score
``s_i + G_i`` is formed with FMA contraction off (``enable_fp_fusion=False``), so the same logits
give the same token on CUDA, under the interpreter and on the CPU reference.

Layout: grid (R, ceil(V / BLOCK)); each program reduces one BLOCK of one row to its
(max score, lowest id at that max) and writes it to [R, tiles] buffers; a torch argmax over the
tiles (first max = lowest tile) and a gather finish the row. No host sync, no loop over rows.
Importing this module imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run
in the Triton interpreter (CPU tensors allowed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import MASK32, MIX_C1, MIX_C2, check_gumbel_args
from epserve.kernels.triton.pdl import pdl

_MASK32 = tl.constexpr(MASK32)
_C1 = tl.constexpr(MIX_C1)
_C2 = tl.constexpr(MIX_C2)


@triton.jit
def _mix32(x):
    """sampling_noise.mix32 on uint32 (multiplication wraps mod 2**32)."""
    x = x ^ (x >> 15)
    x = x * _C1
    x = x ^ (x >> 12)
    x = x * _C2
    return x ^ (x >> 15)


@triton.jit
def _hash(offs, key):
    """h = mix32(mix32(i ^ key_lo) ^ key_hi) for int32 ids ``offs`` and an int64 ``key``."""
    lo = (key & _MASK32).to(tl.uint32)
    hi = ((key >> 32) & _MASK32).to(tl.uint32)
    return _mix32(_mix32(offs.to(tl.uint32) ^ lo) ^ hi)


@triton.jit
def _gumbel(h):
    """float32(-log(-log((h + 0.5) / 2**32))), both logs in float64."""
    u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _noise_kernel(key_ptr, h_ptr, g_ptr, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Writes the hash (as int64) and the Gumbel noise of one BLOCK of one row (for tests)."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    h = _hash(offs, tl.load(key_ptr + row))
    out = row.to(tl.int64) * V + offs
    tl.store(h_ptr + out, h.to(tl.int64), mask=valid)
    tl.store(g_ptr + out, _gumbel(h), mask=valid)


@triton.jit(do_not_specialize=["nb"])
def _gumbel_argmax_kernel(x_ptr, stride_x, key_ptr, inv_t_ptr, noisy_ptr, thr_ptr, tid_ptr,
                          ban_ptr, best_ptr, arg_ptr, V, n_tiles, nb, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """(max, lowest argmax) of ``s + G`` over one BLOCK of one row (see the module docstring).

    nb: banned ids per row (0 = none), -1 padded; checked one id at a time, so only BLOCK-sized
    values stay live. A runtime bound, not specialized: every ban count of a step (they vary
    with each request's stop ids) launches the one compiled variant. Lanes past V are -inf
    and never chosen; a tile whose lanes are all -inf reports its first id (torch.argmax's
    pick)."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    tile = tl.program_id(1)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=valid, other=float("-inf"))
    s = x.to(tl.float32) * tl.load(inv_t_ptr + row)
    for j in range(nb):
        s = tl.where(offs == tl.load(ban_ptr + row * nb + j), float("-inf"), s)
    thr = tl.load(thr_ptr + row)
    tid = tl.load(tid_ptr + row)
    keep = (s > thr) | ((s == thr) & (offs.to(tl.int64) <= tid))
    s = tl.where(keep, s, float("-inf"))
    if tl.load(noisy_ptr + row) != 0:
        s = s + _gumbel(_hash(offs, tl.load(key_ptr + row)))
    best = tl.max(s, axis=0)
    arg = tl.min(tl.where((s == best) & valid, offs, V), axis=0)
    tl.store(best_ptr + row * n_tiles + tile, best)
    tl.store(arg_ptr + row * n_tiles + tile, arg)


def noise_triton(keys: torch.Tensor, vocab: int,
                 block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(hash [R, vocab] int64, Gumbel noise [R, vocab] float32) from the kernel's own helpers;
    must equal ``noise_hash`` / ``gumbel_noise`` bit for bit."""
    r = keys.shape[0]
    h = torch.empty((r, vocab), dtype=torch.int64, device=keys.device)
    g = torch.empty((r, vocab), dtype=torch.float32, device=keys.device)
    if r and vocab:
        _noise_kernel[(r, triton.cdiv(vocab, block))](keys.contiguous(), h, g, vocab, BLOCK=block,
                                                      **pdl(_noise_kernel))
    return h, g


def gumbel_argmax_triton(x: torch.Tensor, keys: torch.Tensor, inv_t: torch.Tensor,
                         noisy: torch.Tensor, thr: torch.Tensor, tid: torch.Tensor,
                         banned: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Triton implementation of ``gumbel_argmax_ref`` (same contract). Returns [R] int64.

    block: vocab entries per program (a power of two >= 16; default min(2048, V rounded up)).
    NaN logits give an unspecified id in range (the reference follows torch.argmax there)."""
    check_gumbel_args(x, keys, inv_t, noisy, thr, tid, banned)
    if block is None:
        block = min(2048, max(16, triton.next_power_of_2(x.shape[1])))
    if block < 16 or block & (block - 1):
        raise ValueError(f"gumbel_argmax_triton: block must be a power of two >= 16, got {block}")
    r, v = x.shape
    if r == 0 or v == 0:
        return torch.zeros(r, dtype=torch.int64, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    n_tiles = triton.cdiv(v, block)
    best = torch.empty((r, n_tiles), dtype=torch.float32, device=x.device)
    arg = torch.empty((r, n_tiles), dtype=torch.int32, device=x.device)
    _gumbel_argmax_kernel[(r, n_tiles)](
        x, x.stride(0), keys.contiguous(), inv_t.to(torch.float32).contiguous(),
        noisy.to(torch.int32).contiguous(), thr.to(torch.float32).contiguous(),
        tid.contiguous(), banned.contiguous(), best, arg, v, n_tiles, banned.shape[1],
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
        enable_fp_fusion=False, **pdl(_gumbel_argmax_kernel))
    tile = torch.argmax(best, dim=1, keepdim=True)
    return arg.gather(1, tile).squeeze(1).to(torch.int64).clamp_(0, v - 1)
