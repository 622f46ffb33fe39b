"""Counter-based sampling noise and the Gumbel-max draw it drives: the pure-torch definition.

Noise. A row's 64-bit key (the sampler ships ``mix_seed(seed, output_index)`` as int64 with the
same bits) and a vocab id ``i`` hash to 32 bits::

    h = mix32(mix32(i ^ key_lo) ^ key_hi)        # key_lo / key_hi: the key's 32-bit halves
    mix32(x) = xs15(mul(xs12(mul(xs15(x), 0x2C1B3C6D)), 0x297A2D39))   # xsN(x) = x ^ (x >> N)

Both multipliers are below 2**31, so ``x * c < 2**63`` and the torch version below is exact in
int64 with an explicit ``& 0xFFFFFFFF``; the Triton kernel computes the same bits in wrapping
uint32. ``U = (h + 0.5) / 2**32`` is uniform on (0, 1) and exact in float64 (all 32 bits kept;
a float32 U would cap the Gumbel tail at 16.6), and the Gumbel noise is
``G = float32(-log(-log U))`` with both logs in float64, so torch on CPU, the Triton interpreter
and CUDA (libdevice) round to the same float32 except with probability ~2**-28 per entry.

Draw (Gumbel-max, the log form of the exponential race ``argmax p_i / E_i``, E_i = -log U_i):
``token = argmax_i (s_i + G_i)`` picks ``i`` with probability ``softmax(s)_i``, where
``s_i = float32(x_i) * inv_t`` (one float32 multiply), set to -inf for banned ids and for ids
outside the row's kept set ``{i : s_i > thr or (s_i == thr and i <= tid)}`` (the first L entries
of a stable descending sort when ``thr, tid`` are its (L-1)-th value and id; ``thr = -inf`` keeps
every id). Rows with ``noisy == 0`` add no noise (greedy). Ties go to the lowest id. A row's
token depends only on its own logits and parameters, never on the other rows.
"""

from __future__ import annotations

import torch

# The hash constants live with the kernel's shared helper; exported here, with the definition.
from epserve.kernels.dispatch import MASK32, MIX_C1, MIX_C2, check_gumbel_args, use_triton

__all__ = ["MASK32", "MIX_C1", "MIX_C2", "apply_bans", "gumbel_argmax", "gumbel_argmax_ref",
           "gumbel_from_hash", "gumbel_noise", "mix32", "noise_hash", "uniform_from_hash"]

_CHUNK = 1 << 19  # reference: hash this many entries at a time (stays in cache on CPU)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser on int64 values in [0, 2**32) (in place on ``x``; returns it)."""
    x ^= x >> 15
    x.mul_(MIX_C1).bitwise_and_(MASK32)
    x ^= x >> 12
    x.mul_(MIX_C2).bitwise_and_(MASK32)
    x ^= x >> 15
    return x


def noise_hash(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """h for keys: [R] int64 (uint64 bits) and ids 0 .. vocab-1: [R, vocab] int64 < 2**32."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = mix32(ids.unsqueeze(0) ^ (keys & MASK32).unsqueeze(1))
    h ^= ((keys >> 32) & MASK32).unsqueeze(1)
    return mix32(h)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """U = (h + 0.5) / 2**32 as float64, in (0, 1)."""
    return h.to(torch.float64).add_(0.5).mul_(2.0 ** -32)


def gumbel_from_hash(h: torch.Tensor) -> torch.Tensor:
    """G = float32(-log(-log U)), both logs in float64."""
    return uniform_from_hash(h).log_().neg_().log_().neg_().to(torch.float32)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Gumbel noise of each key's row: [R] int64 -> [R, vocab] float32."""
    return gumbel_from_hash(noise_hash(keys, vocab))


def apply_bans(s: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Set ``s[r, banned[r, j]]`` to -inf in place for every ``banned[r, j] >= 0`` (-1 pads);
    s: [R, V] float32, banned: [R, NB] int64 ids in [-1, V). Returns s."""
    if banned.numel():
        valid = banned >= 0
        src = torch.where(valid, float("-inf"), float("inf")).to(s.dtype)
        s.scatter_reduce_(1, banned.clamp(min=0), src, reduce="amin", include_self=True)
    return s


def gumbel_argmax_ref(x: torch.Tensor, keys: torch.Tensor, inv_t: torch.Tensor,
                      noisy: torch.Tensor, thr: torch.Tensor, tid: torch.Tensor,
                      banned: torch.Tensor) -> torch.Tensor:
    """The draw defined above, one token per row: x [R, V] float (upcast to float32);
    keys [R] int64; inv_t [R] float32; noisy [R] (nonzero: add noise); thr [R] float32;
    tid [R] int64; banned [R, NB] int64 (-1 pads). Returns [R] int64.

    On CPU (where reading a tensor is free) it skips the keep mask when no row has a cutoff and
    hashes only the noisy rows, a cache-sized block of rows at a time; on other devices (no
    triton there) it runs over all rows at once without a host sync. Same result either way.
    """
    check_gumbel_args(x, keys, inv_t, noisy, thr, tid, banned)
    r, v = x.shape
    lazy = x.device.type == "cpu"
    s = x.float() * inv_t.to(torch.float32).unsqueeze(1)
    apply_bans(s, banned)
    if not lazy or bool((thr > float("-inf")).any()):
        ids = torch.arange(v, device=x.device)
        keep = (s > thr.unsqueeze(1)) | ((s == thr.unsqueeze(1)) & (ids <= tid.unsqueeze(1)))
        s.masked_fill_(~keep, float("-inf"))
    if not lazy:
        return torch.argmax(torch.where(noisy.unsqueeze(1) != 0, s + gumbel_noise(keys, v), s), 1)
    rows = torch.nonzero(noisy != 0).flatten().tolist()
    step = max(1, _CHUNK // max(v, 1))
    for a in range(0, len(rows), step):
        part = rows[a:a + step]
        if part[-1] - part[0] == len(part) - 1:  # a run of rows: add in place on the view
            s[part[0]:part[-1] + 1] += gumbel_noise(keys[part[0]:part[-1] + 1], v)
        else:
            idx = torch.tensor(part, dtype=torch.long)
            s[idx] += gumbel_noise(keys[idx], v)
    return torch.argmax(s, dim=1)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, inv_t: torch.Tensor, noisy: torch.Tensor,
                  thr: torch.Tensor, tid: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """``gumbel_argmax_ref``'s contract; runs ``gumbel_argmax_triton``
    (``epserve.kernels.triton.sampling_noise``) where ``dispatch.use_triton`` says so."""
    if use_triton(x):
        from epserve.kernels.triton.sampling_noise import gumbel_argmax_triton

        return gumbel_argmax_triton(x, keys, inv_t, noisy, thr, tid, banned)
    return gumbel_argmax_ref(x, keys, inv_t, noisy, thr, tid, banned)
