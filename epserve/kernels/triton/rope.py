"""Triton per-head q/k RMSNorm (optional) + rotate-half RoPE in one launch, in place.

Same result as ``epserve.kernels.rope.apply_qk_norm_rope_ref`` (the definition): each head of
q (and k) is RMS-normalised over D with ``q_weight`` (``k_weight``) when that weight is given
(Qwen3) and left as is when it is None (Mixtral, Llama), then rotated by its token's position
(dim ``i < D/2`` paired with ``i + D/2``). Rounding follows the refs: the normalised value is
cast to the input dtype before the float32 weight multiply and the product cast again; the
rotation reads that rounded value in float32 (no fused multiply-add, so each product is rounded
as in torch's eager ops) and casts the result to the input dtype.

The hybrids (Qwen3-Next, Qwen3.5) add two things: partial rotary (a cos/sin cache of R/2 < D/2
columns: dims ``i < R/2`` pair with ``i + R/2``, the last D - R dims pass through, normalised
with the rest) and zero-centred norm weights (``zero_centred``: ``(x / rms) * (1 + w)`` in
float32, one cast, as ``zero_centred_rms_norm_ref``; the 1 is never added in the weight's
dtype). Full rotary without ``zero_centred`` compiles to the code it always was.

With ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping`` given, the same launch also does
``epserve.kernels.kv_write.write_kv_ref(k, v, k_cache, v_cache, slot_mapping)`` on the result
(saving the KV-write launch): the rotated k (already rounded to k's dtype) and v's head go to
slot ``slot_mapping[t]`` cast to the cache dtype; a row with slot < 0 (CUDA-graph padding)
writes nothing. Valid slots must be ``< NB * BS`` and distinct (not checked: device data).

Grid: one program per BLOCK_R consecutive (token, head) rows of k, then of q (a program never
mixes the two tensors; its rows may span tokens, and the last one may run past T, masked), so
any step is a single launch. BLOCK_R and the warps are picked on the host from T * (Hq + Hkv)
and D alone (``pick_tile``; no device reads, fixed per CUDA-graph size): 8 heads of D=128 on 2
warps for decode-sized steps, 16 on 4 warps for long prefills, where one tiny program per
(token, head) left the GPU short of loads in flight (block-count bound; bench/RESULTS.md,
"Kernel tuning history"). The reduction order of the sum of squares may differ with the tile;
every cast point is as above. Each program reads its rows' two halves, then overwrites them;
rows never overlap, so the in-place update is race free; a k program also writes its rows' K
and V cache rows. q, k and v may be strided views (e.g. slices of one fused qkv projection
output viewed as [T, H, D]): any token (row) stride and head stride, last dim contiguous; the
caches need a contiguous last dim (block, offset and head strides free).
CUDA-graph capturable: no host syncs, no allocation; the padding skip is a store mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES, check_devices, check_kv_write_inputs, interpreted
from epserve.kernels.triton.pdl import pdl


@triton.jit
def norm_rope_rows(ptrs, w_ptr, cos, sin, offs, live, eps, HALF, HAS_W: tl.constexpr,
                   tptrs, offs_t, live_t, TAIL, ZC: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Normalise (when HAS_W) and rotate the rows of D = 2 * HALF + TAIL values whose first
    halves start at ``ptrs`` ([R, HALF_P] pointers), in place, lanes outside ``live`` untouched:
    the first 2 * HALF dims rotate, the TAIL after them (``tptrs`` [R, TAIL_P], lanes
    ``live_t``; HAS_TAIL) pass through, normalised with the rest. ZC: the weight is
    zero-centred, ``(x / rms) * (1 + w)`` in float32 and one cast. Returns the three stored
    parts ([R, HALF_P] twice, [R, TAIL_P]; the input dtype; the third is the first again
    without a tail)."""
    x1 = tl.load(ptrs, mask=live, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=live, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o3 = x1
    if HAS_TAIL:
        o3 = tl.load(tptrs, mask=live_t, other=0.0)
    if HAS_W:
        ssq = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        if HAS_TAIL:
            c = o3.to(tl.float32)
            ssq = ssq + tl.sum(c * c, axis=1)
        mean_sq = ssq / (2 * HALF + TAIL)
        rstd = tl.rsqrt(mean_sq + eps)[:, None]
        wmask = offs < HALF
        w1 = tl.load(w_ptr + offs, mask=wmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs, mask=wmask, other=0.0).to(tl.float32)[None, :]
        if ZC:
            a = ((a * rstd) * (1.0 + w1)).to(dtype).to(tl.float32)
            b = ((b * rstd) * (1.0 + w2)).to(dtype).to(tl.float32)
        else:
            a = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            b = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if HAS_TAIL:
            w3 = tl.load(w_ptr + 2 * HALF + offs_t, mask=offs_t < TAIL,
                         other=0.0).to(tl.float32)[None, :]
            if ZC:
                o3 = ((c * rstd) * (1.0 + w3)).to(dtype)
            else:
                o3 = (w3 * (c * rstd).to(dtype).to(tl.float32)).to(dtype)
            tl.store(tptrs, o3, mask=live_t)
    o1 = (a * cos - b * sin).to(dtype)
    o2 = (b * cos + a * sin).to(dtype)
    tl.store(ptrs, o1, mask=live)
    tl.store(ptrs + HALF, o2, mask=live)
    return o1, o2, o3


@triton.jit
def write_kv_rows(k1, k2, v_row, slot, head, kc_ptr, vc_ptr, offs, HALF, block_size,
                  stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                  k3, offs_t, TAIL, HAS_TAIL: tl.constexpr):
    """Write R rows of kv head ``head`` ([R] or scalar) to their cache slots ``slot`` ([R]
    int64; < 0 writes nothing): K from its rotated halves ``k1``, ``k2`` ([R, HALF_P]) and,
    with HAS_TAIL, its pass-through ``k3`` ([R, TAIL_P], dims 2 * HALF on), V read from the
    rows starting at ``v_row`` ([R] pointers), each cast to its cache's dtype."""
    # The slot condition folded into the integer bound (newer interpreters refuse a scalar
    # bool in a mask).
    kv_live = offs[None, :] < tl.where(slot >= 0, HALF, 0)[:, None]
    blk = slot // block_size
    off = slot % block_size
    kc = kc_ptr + (blk * stride_kcb + off * stride_kco + head * stride_kch)[:, None]
    vc = vc_ptr + (blk * stride_vcb + off * stride_vco + head * stride_vch)[:, None]
    tl.store(kc + offs[None, :], k1.to(kc_ptr.dtype.element_ty), mask=kv_live)
    tl.store(kc + HALF + offs[None, :], k2.to(kc_ptr.dtype.element_ty), mask=kv_live)
    v1 = tl.load(v_row[:, None] + offs[None, :], mask=kv_live, other=0.0)
    v2 = tl.load(v_row[:, None] + HALF + offs[None, :], mask=kv_live, other=0.0)
    tl.store(vc + offs[None, :], v1.to(vc_ptr.dtype.element_ty), mask=kv_live)
    tl.store(vc + HALF + offs[None, :], v2.to(vc_ptr.dtype.element_ty), mask=kv_live)
    if HAS_TAIL:
        t_live = offs_t[None, :] < tl.where(slot >= 0, TAIL, 0)[:, None]
        tail = 2 * HALF + offs_t[None, :]
        tl.store(kc + tail, k3.to(kc_ptr.dtype.element_ty), mask=t_live)
        v3 = tl.load(v_row[:, None] + tail, mask=t_live, other=0.0)
        tl.store(vc + tail, v3.to(vc_ptr.dtype.element_ty), mask=t_live)


# T and the k-program count change every step: no ==1 / multiple-of-16 specialization, so each
# tile compiles once (not once per class of T met mid-run).
@triton.jit(do_not_specialize=["num_k_programs", "num_tokens"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                         v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_pos,
                         stride_cos, stride_sin, num_q_heads, num_kv_heads, num_k_programs,
                         HALF, TAIL, eps,
                         stride_vt, stride_vh, stride_slot, block_size,
                         stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                         num_tokens, BLOCK_R: tl.constexpr, HALF_P: tl.constexpr,
                         TAIL_P: tl.constexpr, HAS_QW: tl.constexpr, HAS_KW: tl.constexpr,
                         WRITE_KV: tl.constexpr, ZC: tl.constexpr, HAS_TAIL: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Programs [0, num_k_programs) take BLOCK_R consecutive (token, head) rows of k (token-major,
    # so rows of one token are adjacent in memory), the rest BLOCK_R rows of q: a program never
    # mixes the two tensors. The k programs (which also move v and both cache rows) go first.
    pid = tl.program_id(0)
    is_k = pid < num_k_programs
    heads = tl.where(is_k, num_kv_heads, num_q_heads)
    blk_id = tl.where(is_k, pid, pid - num_k_programs)
    g = blk_id * BLOCK_R + tl.arange(0, BLOCK_R)  # row index over T * heads (int32)
    t = g // heads
    h = g - t * heads
    valid = t < num_tokens
    offs = tl.arange(0, HALF_P)
    # Lanes in range: a row past the end, or the padding lanes of HALF_P, touch nothing. The row
    # condition is folded into an integer bound (no bool tensor built from a scalar).
    live = offs[None, :] < tl.where(valid, HALF, 0)[:, None]
    offs_t = tl.arange(0, TAIL_P)  # partial rotary: the dims after the rotated 2 * HALF
    live_t = offs_t[None, :] < tl.where(valid, TAIL, 0)[:, None]
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    pos = tl.load(pos_ptr + t64 * stride_pos, mask=valid, other=0).to(tl.int64)
    cos = tl.load(cos_ptr + pos[:, None] * stride_cos + offs[None, :], mask=live,
                  other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos[:, None] * stride_sin + offs[None, :], mask=live,
                  other=0.0).to(tl.float32)
    if is_k:
        krow = (k_ptr + t64 * stride_kt + h64 * stride_kh)[:, None]
        k1, k2, k3 = norm_rope_rows(krow + offs[None, :], kw_ptr, cos, sin, offs, live, eps,
                                    HALF, HAS_KW, krow + 2 * HALF + offs_t[None, :], offs_t,
                                    live_t, TAIL, ZC, HAS_TAIL)
        if WRITE_KV:
            # a row past the end reads slot -1: it writes nothing, as padding
            slot = tl.load(slot_ptr + t64 * stride_slot, mask=valid, other=-1).to(tl.int64)
            write_kv_rows(k1, k2, v_ptr + t64 * stride_vt + h64 * stride_vh, slot, h64, kc_ptr,
                          vc_ptr, offs, HALF, block_size, stride_kcb, stride_kco, stride_kch,
                          stride_vcb, stride_vco, stride_vch, k3, offs_t, TAIL, HAS_TAIL)
    else:
        qrow = (q_ptr + t64 * stride_qt + h64 * stride_qh)[:, None]
        norm_rope_rows(qrow + offs[None, :], qw_ptr, cos, sin, offs, live, eps, HALF, HAS_QW,
                       qrow + 2 * HALF + offs_t[None, :], offs_t, live_t, TAIL, ZC, HAS_TAIL)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_qk_norm_rope_kernel)


# Tile: BLOCK_R (token, head) rows of one tensor per program, sized by elements per half-row
# tile (BLOCK_R * HALF_P), 8 per thread (one 16-byte vector of a 16-bit dtype, two of fp32).
# Small steps (decode, up to a few hundred tokens) take 512 elements: 8 heads of D=128 on 2
# warps, so T=1 at 32 + 4 heads is 4 + 1 programs and a T=256 step still fills the GPU. From
# _LARGE_MIN_ROWS (token, head) rows on (T >= 456 at 32 + 4 heads) 1024: 16 heads on 4 warps.
_SMALL_ELEMS, _LARGE_ELEMS, _LARGE_MIN_ROWS, _MAX_ROWS = 512, 1024, 16384, 32


def pick_tile(rows: int, half_p: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps) for ``rows`` = T * (Hq + Hkv) and the padded half head_dim; a pure
    function of the shapes (no device reads), so each CUDA-graph size gets one fixed tile."""
    elems = _LARGE_ELEMS if rows >= _LARGE_MIN_ROWS else _SMALL_ELEMS
    block_r = max(1, min(_MAX_ROWS, elems // half_p))
    return block_r, max(1, min(8, block_r * half_p // 256))


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                        cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, *, v: torch.Tensor | None = None,
                        k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                        slot_mapping: torch.Tensor | None = None, zero_centred: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite q and k with ``apply_qk_norm_rope_ref(...)``; returns the same (q, k) objects.
    With v, k_cache, v_cache, slot_mapping (all or none) it then also does
    ``write_kv_ref(k, v, k_cache, v_cache, slot_mapping)``, in the same launch.

    q: [T, Hq, D], k: [T, Hkv, D], one dtype of fp32/fp16/bf16, last dim contiguous (token and
    head strides free); positions: [T] int64/int32 with ``0 <= positions < P`` (not checked: it
    lives on the device); cos_cache, sin_cache: [P, R/2] floating, last dim contiguous (R <= D
    rotary dims: with R < D the last D - R dims of every head pass through, normed);
    q_weight / k_weight: [D] or None (no norm for that tensor), zero-centred (``1 + w``, added
    in float32) with ``zero_centred``. v: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]; v and
    the caches each fp32/fp16/bf16 with a contiguous last dim; slot_mapping: [T] int64/int32,
    -1 for a row that writes nothing.
    """
    name = "qk_norm_rope_triton"
    kv_args = (v, k_cache, v_cache, slot_mapping)
    with_kv = check_qk_norm_rope_args(name, q, k, positions, cos_cache, sin_cache, q_weight,
                                      k_weight, kv_args)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0 or hq + hkv == 0 or d == 0:
        return q, k
    if t * max(hq, hkv) >= 2**31 - _MAX_ROWS:  # the kernel indexes (token, head) rows in int32
        raise ValueError(f"{name}: {t} tokens x {max(hq, hkv)} heads is too many rows")
    half = cos_cache.shape[1]
    qw = q_weight.contiguous() if q_weight is not None else q
    kw = k_weight.contiguous() if k_weight is not None else k
    if with_kv:
        kv_ptrs = (v, k_cache, v_cache, slot_mapping)
        kv_strides = (v.stride(0), v.stride(1), slot_mapping.stride(0), k_cache.shape[1],
                      *k_cache.stride()[:3], *v_cache.stride()[:3])
    else:  # unused by the kernel (WRITE_KV=False): placeholders of the right kinds
        kv_ptrs = (k, k, k, positions)
        kv_strides = (0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    tail = d - 2 * half
    # the tile is sized by the head's half width (the rotated half plus half the tail)
    block_r, num_warps = pick_tile(t * (hq + hkv), triton.next_power_of_2(d // 2))
    n_k = triton.cdiv(t * hkv, block_r)
    grid = (n_k + triton.cdiv(t * hq, block_r),)
    _qk_norm_rope_kernel[grid](
        q, k, positions, cos_cache, sin_cache, qw, kw, *kv_ptrs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0),
        cos_cache.stride(0), sin_cache.stride(0), hq, hkv, n_k, half, tail, float(eps),
        *kv_strides, t, BLOCK_R=block_r, HALF_P=triton.next_power_of_2(half),
        TAIL_P=triton.next_power_of_2(max(tail, 1)), HAS_QW=q_weight is not None,
        HAS_KW=k_weight is not None, WRITE_KV=with_kv, ZC=bool(zero_centred),
        HAS_TAIL=tail > 0, num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl(_qk_norm_rope_kernel))  # products rounded before the add/sub, as torch's eager ops
    return q, k


def check_qk_norm_rope_args(name: str, q: torch.Tensor, k: torch.Tensor,
                            positions: torch.Tensor, cos_cache: torch.Tensor,
                            sin_cache: torch.Tensor, q_weight: torch.Tensor | None,
                            k_weight: torch.Tensor | None, kv_args: tuple) -> bool:
    """Shape, stride, dtype and device checks of ``qk_norm_rope_triton``'s arguments
    (``kv_args``: v, k_cache, v_cache, slot_mapping, all or none None); True when the KV-write
    arguments are given."""
    v, k_cache, v_cache, slot_mapping = kv_args
    with_kv = all(x is not None for x in kv_args)
    if not with_kv and any(x is not None for x in kv_args):
        raise ValueError(f"{name}: v, k_cache, v_cache and slot_mapping go together (all or none)")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         f"[T, Hq, D] and [T, Hkv, D]")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must share T and an "
                         f"even head_dim")
    if positions.shape != (t,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: positions {tuple(positions.shape)} {positions.dtype} must be "
                         f"[{t}] int64 or int32")
    if (cos_cache.dim() != 2 or cos_cache.shape != sin_cache.shape
            or not 1 <= cos_cache.shape[1] <= d // 2):
        raise ValueError(f"{name}: cos/sin caches {tuple(cos_cache.shape)} / "
                         f"{tuple(sin_cache.shape)} must both be [P, R/2], R <= head_dim {d}")
    if not (cos_cache.is_floating_point() and sin_cache.is_floating_point()):
        raise ValueError(f"{name}: cos/sin caches must be floating, got {cos_cache.dtype}, "
                         f"{sin_cache.dtype}")
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise ValueError(f"{name}: q {q.dtype} and k {k.dtype} must share one of {DTYPES}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_cache.stride(1) != 1 or sin_cache.stride(1) != 1:
        raise ValueError(f"{name}: q, k, cos_cache, sin_cache need a contiguous last dim; strides "
                         f"{q.stride()}, {k.stride()}, {cos_cache.stride()}, {sin_cache.stride()}")
    if any(n > 1 and st == 0 for x in (q, k) for n, st in zip(x.shape[:2], x.stride()[:2])):
        raise ValueError(f"{name}: q and k are written in place and must not be broadcast views "
                         f"(zero strides {q.stride()}, {k.stride()})")
    for wname, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (d,) or not w.is_floating_point()):
            raise ValueError(f"{name}: {wname} {tuple(w.shape)} {w.dtype} must be [{d}] floating")
    if with_kv:
        check_kv_write_inputs(name, k, v, k_cache, v_cache, slot_mapping)
    tensors = [x for x in (q, k, positions, cos_cache, sin_cache, q_weight, k_weight) + kv_args
               if x is not None]
    check_devices(name, tensors, INTERPRETED, "epserve.kernels.triton.rope")
    return with_kv
