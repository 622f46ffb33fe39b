"""Triton or reference: the one decision, and what an op's entry shares with its Triton module.

``use_triton(x)`` decides for every op: its Triton kernel runs for CUDA tensors, or anywhere
while ``TRITON_INTERPRET=1`` (the Triton interpreter: the CPU tests), when triton imports; each
op's entry then adds only the shapes, dtypes and layouts its kernel covers, and runs its torch
reference otherwise.

The rest is shared by an op module (``epserve/kernels/<op>.py``: the reference and the entry)
and its Triton module (``epserve/kernels/triton/<name>.py``), which imports nothing of this
package but this module (and sibling Triton modules), so imports run op -> Triton, never back:
the kernels' limits the entries read before importing triton, the argument checks both raise
from (``ValueError`` naming the caller and the offending tensor), and the constants of the
sampling noise hash; the per-slot state helpers of the gated-DeltaNet ops (``gather_states``,
``check_state_step``) and what their varlen kernels take for a short step (``short_step``,
``varlen_tensors``). Nothing here imports triton at module level or reads device memory.

``fla_function`` is the other decision: fla-core's kernels (the gated-DeltaNet prefill), an
optional extra imported lazily, only for CUDA tensors outside the interpreter.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Sequence

import torch

#: The dtypes every Triton kernel here takes.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Hidden sizes the norm kernels cover: one block of ``next_power_of_2(H)`` lanes per row.
MAX_NORM_H = 8192
#: Experts the router kernels take: one [rows, next_pow2(E)] register tile per program.
MAX_TRITON_EXPERTS = 512
#: The most rows the fused norm + router launch takes (each program re-normalises its row).
MAX_FUSED_TOKENS = 64

#: Key head dims the gated-delta decode kernel takes: one [Dk, BV] float32 state tile a program.
MAX_DELTA_DK = 256
#: Conv widths the causal-conv update kernel takes (the window is unrolled).
MAX_CONV_WIDTH = 8
#: Most tokens a sequence has in a short step: a speculative verify's k + 1 or a fold's prefix.
MAX_SHORT_TOKENS = 16

#: The sampling noise hash (``sampling_noise``'s definition, the kernel's bits): 32-bit mask and
#: the two odd multipliers of ``mix32``, each below 2**31 so int64 products are exact.
MASK32 = 0xFFFFFFFF
MIX_C1, MIX_C2 = 0x2C1B3C6D, 0x297A2D39


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (it is optional: without it every device runs the reference);
    tried once per process."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


log = logging.getLogger(__name__)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the op on ``x`` runs its Triton kernel: ``x`` on CUDA, or any device while
    ``TRITON_INTERPRET=1``, and triton importable. Layout and dtype limits are the op's."""
    return (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_available()


_FLA_MISSING: list[str] = []  # the first import that failed: logged once per process


@functools.cache
def _fla_module(module: str):
    """``module`` of fla-core, or None when it is not installed (one log line a process)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if not _FLA_MISSING:
            _FLA_MISSING.append(module)
            log.warning("fla-core is not installed (%s): gated-DeltaNet prefill runs the torch "
                        "reference on CUDA (pip install 'epserve[gpu]')", exc)
        return None


def fla_function(x: torch.Tensor, module: str, name: str):
    """fla-core's ``module.name`` for an op on ``x``, or None: only for a CUDA ``x`` outside the
    Triton interpreter (importing fla breaks the interpreter in the same process, so the CPU
    path never imports it), and only where fla-core is installed (an optional extra)."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or not triton_available():
        return None
    mod = _fla_module(module)
    return None if mod is None else getattr(mod, name)


_OFFSETS: list = [None, None, None]  # [cu_seqlens, cu on its device, cu on the host]


def fla_offsets(cu_seqlens, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` (host ints) as int64 tensors on ``device`` and on the host, for fla's varlen
    kernels. One step's layers pass the same tuple: they share one pair (and fla's caches keyed
    on it), held here until the next step's tuple."""
    c = _OFFSETS
    if c[0] is cu_seqlens and c[1].device == device:
        return c[1], c[2]
    cpu = torch.tensor(cu_seqlens, dtype=torch.int64)
    c[:] = [cu_seqlens if isinstance(cu_seqlens, tuple) else None, cpu.to(device), cpu]
    return c[1], c[2]


def short_step(cu_seqlens: Sequence[int], rows: int) -> bool:
    """Whether a step's host offsets (from 0, non-decreasing, ending at its ``rows``: the
    varlen kernels compute no row past the last sequence) give each sequence at most
    ``MAX_SHORT_TOKENS`` tokens: a step for the gated-DeltaNet ops' varlen kernels."""
    return len(cu_seqlens) > 0 and cu_seqlens[0] == 0 and cu_seqlens[-1] == rows and all(
        0 <= b - a <= MAX_SHORT_TOKENS for a, b in zip(cu_seqlens, cu_seqlens[1:]))


_VARLEN: list = [None, None]  # the last short step's (offsets, hold, device), and its tensors


def varlen_tensors(cu_seqlens: Sequence[int], hold: Sequence[int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A short step's offsets as int32 [S + 1] and its hold mask [S] bool (True: the sequence's
    new state is not written back; ``hold``: host indices) on ``device``, in one host-to-device
    copy. A step's layers and ops pass the same offsets and holds: they share the last pair
    (read only)."""
    key = (tuple(cu_seqlens), tuple(hold), device)
    if _VARLEN[0] != key:
        s = len(cu_seqlens) - 1
        mask = torch.zeros(s, dtype=torch.bool)
        if hold:
            mask[list(hold)] = True
        host = torch.cat([torch.tensor(cu_seqlens, dtype=torch.int32).view(torch.uint8),
                          mask.view(torch.uint8)])
        dev = host.to(device)
        cut = 4 * (s + 1)  # the offsets' bytes
        _VARLEN[:] = [key, (dev[:cut].view(torch.int32), dev[cut:].view(torch.bool))]
    return _VARLEN[1]


def gather_states(pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The per-slot states of a step's sequences, copied out of ``pool`` [N, ...]:
    ``pool[slots]`` [S, ...], zeros where ``fresh[s]`` (a sequence that starts from nothing)."""
    return pool[slots].masked_fill(fresh.view(-1, *(1,) * (pool.dim() - 1)), 0)


def scatter_states(pool: torch.Tensor, slots: torch.Tensor, new: torch.Tensor,
                   hold: Sequence[int] = ()) -> None:
    """Write a step's new per-sequence states ``new`` [S, ...] back into ``pool`` at ``slots``,
    except the sequences listed in ``hold`` (host indices into the step's sequences: a
    speculative verify's, whose accepted prefix is folded in once the verdict is known)."""
    if hold:
        held = set(hold)
        keep = [s for s in range(len(new)) if s not in held]
        if not keep:
            return
        idx = torch.tensor(keep, device=new.device)
        slots, new = slots[idx], new[idx]
    pool[slots] = new.to(pool.dtype)


def check_hold(name: str, hold: Sequence[int], num_seqs: int, decode: bool) -> None:
    """``hold`` names distinct sequences of the step, and not on a decode step (the decode
    kernels write every row's state)."""
    if not hold:
        return
    if decode:
        raise ValueError(f"{name}: held sequences {list(hold)} on a decode step")
    if len(set(hold)) != len(hold) or not all(0 <= h < num_seqs for h in hold):
        raise ValueError(f"{name}: held sequences {list(hold)} must be distinct indices of the "
                         f"step's {num_seqs} sequences")


def check_state_step(name: str, pool: torch.Tensor, shape: tuple[int, ...], slots: torch.Tensor,
                     fresh: torch.Tensor, rows: int | None = None) -> int:
    """A step over per-slot states: ``pool`` [N, *shape] (one of ``DTYPES``), ``slots`` [S] int64
    or int32 and ``fresh`` [S] bool on the pool's device (``S == rows`` where given). Returns S.
    The slots' values live on the device: not checked (each < N, distinct but for padding)."""
    if pool.dim() != len(shape) + 1 or tuple(pool.shape[1:]) != tuple(shape):
        raise ValueError(f"{name}: state pool {tuple(pool.shape)} must be [N, "
                         f"{', '.join(map(str, shape))}]")
    if pool.dtype not in DTYPES:
        raise ValueError(f"{name}: state pool dtype {pool.dtype} must be one of {DTYPES}")
    s = slots.shape[0] if slots.dim() == 1 else -1
    if s < 0 or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: slots {tuple(slots.shape)} {slots.dtype} must be [S] int64 "
                         f"or int32")
    if fresh.shape != (s,) or fresh.dtype != torch.bool:
        raise ValueError(f"{name}: fresh {tuple(fresh.shape)} {fresh.dtype} must be [{s}] bool")
    if rows is not None and rows != s:
        raise ValueError(f"{name}: {rows} rows for {s} sequences (a decode step is one row each)")
    if slots.device != pool.device or fresh.device != pool.device:
        raise ValueError(f"{name}: slots on {slots.device}, fresh on {fresh.device}, state pool "
                         f"on {pool.device}")
    return s


def interpreted(kernel) -> bool:
    """Whether a ``triton.jit`` kernel was defined under the interpreter (``TRITON_INTERPRET=1``
    when its module was imported): it then runs on CPU tensors, and on nothing else."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_devices(name: str, tensors, interpreted: bool, module: str) -> None:
    """All ``tensors`` on one device, and that device CUDA unless ``module``'s kernels were
    defined under the Triton interpreter (``interpreted``)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"{name}: {device} tensors need TRITON_INTERPRET=1 when "
                         f"{module} is first imported")


def check_paged_inputs(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor) -> tuple[int, int, int, int, int]:
    """q [T, Hq, D] (last dim contiguous); caches [NB, BS, Hkv, D] contiguous, q's dtype (one of
    ``DTYPES``), Hq a multiple of Hkv; block_tables [S, max_blocks] int32, last dim contiguous.
    Returns ``(T, Hq, D, BS, Hkv)``."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q {tuple(q.shape)} must be [T, Hq, D]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must "
                         f"both be [NB, BS, Hkv, D]")
    t, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"{name}: q head_dim {d} != cache head_dim {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: {hq} query heads is not a multiple of {hkv} kv heads")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{name}: dtypes q {q.dtype}, k_cache {k_cache.dtype}, v_cache "
                         f"{v_cache.dtype} must be equal and one of {DTYPES}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: k_cache and v_cache must be contiguous")
    if q.stride(2) != 1:
        raise ValueError(f"{name}: q must have a contiguous last dim, strides {q.stride()}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables {tuple(block_tables.shape)} {block_tables.dtype} "
                         f"must be [S, max_blocks] int32 with a contiguous last dim")
    return t, hq, d, bs, hkv


def check_kv_write_inputs(name: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> tuple[int, int, int]:
    """k, v [T, Hkv, D]; caches [NB, BS, Hkv, D]; all four one of ``DTYPES`` (each its own) with a
    contiguous last dim (other strides free); slot_mapping [T] int64 or int32. Returns
    ``(T, Hkv, D)``."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"[T, Hkv, D]")
    t, hkv, d = k.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must "
                         f"both be [NB, BS, {hkv}, {d}]")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: slot_mapping {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype} must be [{t}] int64 or int32")
    dtypes = (k.dtype, v.dtype, k_cache.dtype, v_cache.dtype)
    if any(dt not in DTYPES for dt in dtypes):
        raise ValueError(f"{name}: k, v, k_cache, v_cache dtypes {dtypes} must be in {DTYPES}")
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)) and d > 1:
        raise ValueError(f"{name}: k, v, k_cache, v_cache need a contiguous last dim")
    return t, hkv, d


def check_router_args(name: str, logits: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless logits is a 2-D float tensor [T, E] and ``1 <= top_k <= E``."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be 2-D [T, E], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{name}: logits must be floating point, got {logits.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"{name}: top_k must be an int, got {top_k!r}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"{name}: top_k must be in [1, E={logits.shape[1]}], got {top_k}")


def check_gumbel_args(x, keys, inv_t, noisy, thr, tid, banned) -> None:
    """The Gumbel-max draw's arguments: x [R, V] float; keys, inv_t, noisy, thr, tid [R];
    banned [R, NB]; keys, tid and banned int64."""
    r = x.shape[0]
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"gumbel_argmax: x must be a 2-D float tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    for name, t in (("keys", keys), ("inv_t", inv_t), ("noisy", noisy), ("thr", thr), ("tid", tid)):
        if tuple(t.shape) != (r,):
            raise ValueError(f"gumbel_argmax: {name} must be [{r}], got {tuple(t.shape)}")
    if banned.dim() != 2 or banned.shape[0] != r:
        raise ValueError(f"gumbel_argmax: banned must be [{r}, NB], got {tuple(banned.shape)}")
    if keys.dtype != torch.int64 or tid.dtype != torch.int64 or banned.dtype != torch.int64:
        raise ValueError("gumbel_argmax: keys, tid and banned must be int64")
