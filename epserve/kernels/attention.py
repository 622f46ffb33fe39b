"""Paged KV writes and paged attention over a flat batch of ragged sequences; refs are the definition.

Invariants: a batch is ``T`` rows, sequence ``s`` owns rows ``[query_start_loc[s],
query_start_loc[s+1])`` and its new tokens are the last ``n_s`` of its ``seq_lens[s]`` KV
positions; rows past ``query_start_loc[-1]`` are padding (slot -1, output zeros). Attention is
causal within a sequence, computed in float32 and returned in the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from epserve.kernels.dispatch import DTYPES, use_triton


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one step's rows live in the paged KV cache (built by the runner, read by attention).

    - ``slot_mapping``: [T] int64 on device; flat KV slot ``block_id * block_size + offset``
      where row t's K/V is written; -1 marks a padded row (nothing written).
    - ``query_start_loc``: host, S+1 entries; rows of sequence s are ``[qsl[s], qsl[s+1])``.
    - ``seq_lens``: host, S entries; KV length of sequence s after this step (its new tokens
      included), so its new tokens sit at positions ``seq_lens[s]-n_s .. seq_lens[s]-1``.
    - ``block_tables``: [S, max_blocks] int32 on device, logical -> physical block, 0-padded.
    - ``block_size``: tokens per KV block.
    - ``seq_lens_t``: optional [S] int32 on device, the same lengths as ``seq_lens``. When set
      on a pure decode batch (one row per sequence) it is the source of truth: attention reads
      it on the device and trusts it, so a CUDA graph can replay with new lengths while the
      host tuple holds placeholders. Padded decode rows carry length 1 and slot -1.
    - ``state_slots``: optional [S] int64 on device, the state slot of each sequence (same
      order as the ``query_start_loc`` segments), read only by linear-attention (gated
      DeltaNet) layers, whose per-layer cache is ``(conv_state [N, C, K-1], recurrent_state
      [N, Hv, Dk, Dv] float32)`` over the rank's N state slots. Such a layer reads sequence
      s's states from slot ``state_slots[s]``, or zeros when s starts fresh: its KV length
      before the step is 0, ``seq_lens[s] - (qsl[s+1] - qsl[s]) == 0`` (host values; on a
      pure decode batch with ``seq_lens_t`` set, ``seq_lens_t[s] == 1`` on the device). It
      runs its tokens and writes the new states back into the same slots, in place. A
      padded decode row of a CUDA graph is a one-row sequence of length 1 (so fresh) whose
      slot is the rank's spare scratch slot: it touches no other slot. The real sequences of
      a step never share a slot (padded ones may all share the spare).
    - ``state_runs``: optional ``StateRuns``, set when the linear-attention layers group the
      rows into sequences other than attention's (a speculative verify's): then they read it
      instead of ``query_start_loc``, ``state_slots`` and the lengths.
    """

    slot_mapping: torch.Tensor
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: torch.Tensor
    block_size: int
    seq_lens_t: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    state_runs: "StateRuns | None" = None

    def __post_init__(self) -> None:
        s = len(self.seq_lens)
        if self.state_slots is not None and tuple(self.state_slots.shape) != (s,):
            raise ValueError(f"AttentionMetadata: state_slots shape {tuple(self.state_slots.shape)}"
                             f" does not match {s} sequences")
        if len(self.query_start_loc) != s + 1:
            raise ValueError(f"AttentionMetadata: query_start_loc has {len(self.query_start_loc)} "
                             f"entries, expected len(seq_lens) + 1 = {s + 1}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != s:
            raise ValueError(f"AttentionMetadata: block_tables shape {tuple(self.block_tables.shape)}"
                             f" does not match {s} sequences")
        # Per-sequence row counts are checked in ``validate`` (the reference attention calls it):
        # a loop here would cost more than the rest of a 256-row decode step's host work.

    def validate(self) -> None:
        """Each sequence has at most ``seq_len`` new rows (O(S) on the host)."""
        for i in range(len(self.seq_lens)):
            n = self.query_start_loc[i + 1] - self.query_start_loc[i]
            if n < 0 or n > self.seq_lens[i]:
                raise ValueError(f"AttentionMetadata: sequence {i} has {n} new rows but "
                                 f"seq_len {self.seq_lens[i]}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class StateRuns:
    """How a step's linear-attention (gated DeltaNet) layers group its rows into sequences when
    attention groups them otherwise: a speculative verify's ``k + 1`` positions are ``k + 1``
    one-token rows for attention (each attends to its sequence's KV up to itself, as a decode
    row: the decode kernels and graphs run it) but one sequence for the recurrence, which runs
    them in order from the sequence's state and, held, does not write the state back.

    Host side: ``cu`` (S + 1 offsets over the step's rows; the runs cover the rows in order),
    ``slots`` ([S] int64 numpy, each run's state slot), ``fresh`` ([S] bool numpy: starts from
    zeros) and ``hold`` (indices of the held runs, whose new states are not written back: each
    layer instead appends its conv inputs and projections a, b of every row to ``log``, in
    layer order, and ``fold`` advances the held states by an accepted prefix afterwards).
    Device side: ``tensors`` gives (slots int64, cu int32, fresh bool, hold bool), shipped
    once a step, or the static buffers a CUDA graph replays them from (``device``: then the
    host side holds the capture's placeholders and the device tensors are the truth; every
    run is then at most ``dispatch.MAX_SHORT_TOKENS`` rows).
    """

    __slots__ = ("cu", "slots", "fresh", "hold", "log", "device")

    def __init__(self, cu: tuple[int, ...], slots, fresh, hold: tuple[int, ...],
                 device: tuple[torch.Tensor, ...] | None = None):
        self.cu, self.hold = cu, hold
        self.slots = np.asarray(slots, dtype=np.int64)
        self.fresh = np.asarray(fresh, dtype=bool)
        s = len(cu) - 1
        if s < 0 or cu[0] != 0 or self.slots.shape != (s,) or self.fresh.shape != (s,) or \
                any(b < a for a, b in zip(cu, cu[1:])) or \
                not all(0 <= h < s for h in hold) or len(set(hold)) != len(hold):
            raise ValueError(f"StateRuns: offsets {list(cu)}, {self.slots.shape[0]} slots, "
                             f"{self.fresh.shape[0]} fresh flags, holds {list(hold)}")
        self.log: list = []
        self.device = device

    @property
    def num_runs(self) -> int:
        return len(self.cu) - 1

    def padded(self, rows: int, runs: int, spare: int) -> "StateRuns":
        """These runs, then each row after them up to ``rows`` a held one-row run from zeros on
        the ``spare`` slot (it reads and writes no state), then empty held runs up to ``runs``
        runs: the layout a CUDA graph's grid of ``runs`` programs replays."""
        s, n = self.num_runs, self.cu[-1]
        if n > rows or s + rows - n > runs:
            raise ValueError(f"StateRuns: {s} runs over {n} rows do not pad to {runs} runs "
                             f"over {rows} rows")
        cu = self.cu + tuple(range(n + 1, rows + 1)) + (rows,) * (runs - s - (rows - n))
        pad = runs - s
        return StateRuns(cu, np.concatenate([self.slots, np.full(pad, spare)]),
                         np.concatenate([self.fresh, np.ones(pad, dtype=bool)]),
                         self.hold + tuple(range(s, runs)))

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(slots [S] int64, cu [S + 1] int32, fresh [S] bool, hold [S] bool) on ``device``:
        one host-to-device copy, made once."""
        if self.device is None:
            s = self.num_runs
            at = [0]  # each section 16-byte aligned
            for size in (8 * s, 4 * (s + 1), s):
                at.append(-(-(at[-1] + size) // 16) * 16)
            host = np.zeros(at[3] + s, dtype=np.uint8)
            host[:8 * s] = self.slots.view(np.uint8)
            host[at[1]:at[1] + 4 * (s + 1)] = np.asarray(self.cu, dtype=np.int32).view(np.uint8)
            host[at[2]:at[2] + s] = self.fresh
            host[at[3]:at[3] + s][list(self.hold)] = 1
            dev = torch.from_numpy(host).to(device)
            self.device = (dev[:8 * s].view(torch.int64), dev[at[1]:at[1] + 4 * (s + 1)].view(
                torch.int32), dev[at[2]:at[2] + s].view(torch.bool),
                dev[at[3]:at[3] + s].view(torch.bool))
        return self.device


# --------------------------------------------------------------------------- paged attention


def _gather_seq_kv(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached positions of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = -(-seq_len // block_size)
    blocks = block_row[:n_blocks].long()
    return cache[blocks].reshape(n_blocks * block_size, *cache.shape[2:])[:seq_len]


def _visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[n, L] bool: query at position p sees keys at positions <= p (and > p - window)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its paged KV (already written).

    q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D] with Hq a multiple of Hkv (query head h
    reads kv head ``h // (Hq // Hkv)``). Returns [T, Hq, D] in q.dtype; padded rows are zero.
    """
    meta.validate()
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    for s in range(meta.num_seqs):
        start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        n, seq_len = end - start, meta.seq_lens[s]
        if n == 0:
            continue
        k = _gather_seq_kv(k_cache, meta.block_tables[s], seq_len).float()  # [L, Hkv, D]
        v = _gather_seq_kv(v_cache, meta.block_tables[s], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[start:end].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale  # [Hq, n, L]
        k_pos = torch.arange(seq_len, device=q.device)
        q_pos = k_pos[seq_len - n:]
        mask = _visible_mask(q_pos, k_pos, sliding_window)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out.to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Public entry for ``paged_attention_ref`` (same contract); picks the implementation
    where ``dispatch.use_triton`` says so: the Triton decode kernel
    (``epserve.kernels.triton.paged_attention``) for pure decode batches, the Triton prefill
    kernel (``epserve.kernels.triton.paged_prefill``) for any other batch; else the reference.

    q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]. Returns [T, Hq, D] q.dtype.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} must be [T, Hq, D] and caches "
                         f"{tuple(k_cache.shape)} [NB, BS, Hkv, D] with the same D")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads is not a multiple of "
                         f"{k_cache.shape[2]} kv heads")
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"paged_attention: cache block size {k_cache.shape[1]} != "
                         f"meta.block_size {meta.block_size}")
    if use_triton_decode(q, meta):
        from epserve.kernels.triton.paged_attention import paged_decode_attention

        lens = meta.seq_lens_t if meta.seq_lens_t is not None else _seq_lens_tensor(meta, q.device)
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, lens, scale,
                                      sliding_window)
    if _use_triton_prefill(q, k_cache, v_cache, meta, sliding_window):
        tiles = _prefill_tile_map(meta, q, k_cache.shape[2])
        if tiles is not None:  # else out of contract: the reference raises or defines it
            from epserve.kernels.triton.paged_prefill import paged_prefill_attention

            return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, tiles, scale,
                                           sliding_window)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window)


def use_triton_decode(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """The Triton decode kernel runs: ``use_triton`` and one row per sequence (with lengths in
    contract, or device lengths, which are trusted)."""
    if not use_triton(q):
        return False
    s = meta.num_seqs
    if s == 0 or q.shape[0] != s or meta.query_start_loc != tuple(range(s + 1)):
        return False
    if meta.seq_lens_t is not None:  # device lengths (graph replay): trusted
        return True
    # Out-of-contract lengths go to the reference, which raises or defines the result.
    cap = meta.block_tables.shape[1] * meta.block_size
    return min(meta.seq_lens) >= 1 and max(meta.seq_lens) <= cap


def _use_triton_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """Triton prefill kernel: ``use_triton``, a batch that is not pure decode, tensors in the
    kernel's layout and a window that is None or a positive int (anything else keeps the
    reference)."""
    if not use_triton(q):
        return False
    if sliding_window is not None and not (type(sliding_window) is int and sliding_window >= 1):
        return False
    s = meta.num_seqs
    if s == 0 or meta.query_start_loc == tuple(range(s + 1)):
        return False
    bt = meta.block_tables
    if not (q.dtype in DTYPES and k_cache.dtype == q.dtype == v_cache.dtype
            and k_cache.shape == v_cache.shape and q.stride(2) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and bt.dtype == torch.int32 and bt.stride(1) == 1
            and q.device == k_cache.device == v_cache.device == bt.device):
        return False
    # ``from <module> import name`` reads sys.modules (``from <package> import <module>``
    # would read a package attribute that a test may have swapped the module under).
    from epserve.kernels.triton.paged_prefill import INTERPRETED

    # A module compiled for the GPU (imported before TRITON_INTERPRET was set) cannot run on CPU.
    return q.is_cuda or INTERPRETED


_PREFILL_TILES_CACHE: list = [None, None, None, None]  # [meta, device, tok, TileMap | None]


def _prefill_tile_map(meta: AttentionMetadata, q: torch.Tensor, num_kv_heads: int):
    """The prefill kernel's ``TileMap`` for ``meta`` on q's device, built once per metadata
    object (one step's layers share it: one H2D copy per step); None when ``meta`` is out of
    contract (a sequence with more new rows than its length, or longer than its block table)."""
    from epserve.kernels.triton.paged_prefill import (build_tile_map, default_block_m,
                                                      tokens_per_tile)

    tok = tokens_per_tile(q.shape[1], num_kv_heads, default_block_m(q.device))
    c = _PREFILL_TILES_CACHE
    if c[0] is meta and c[1] == q.device and c[2] == tok:
        tiles = c[3]
    else:
        qsl, lens = meta.query_start_loc, meta.seq_lens
        cap = meta.block_tables.shape[1] * meta.block_size
        ok = qsl[0] >= 0 and all(0 <= qsl[i + 1] - qsl[i] <= lens[i] <= cap
                                 for i in range(len(lens)))
        tiles = build_tile_map(qsl, lens, tok, q.device) if ok else None
        c[:] = [meta, q.device, tok, tiles]
    if tiles is not None and tiles.row_hi > q.shape[0]:
        return None
    return tiles


_SEQ_LENS_CACHE: list = [None, None, None]  # [meta, device, tensor]: one step's layers share it


def _seq_lens_tensor(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """``meta.seq_lens`` as a [S] int32 tensor on ``device``, built once per metadata object."""
    if _SEQ_LENS_CACHE[0] is meta and _SEQ_LENS_CACHE[1] == device:
        return _SEQ_LENS_CACHE[2]
    t = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
    _SEQ_LENS_CACHE[:] = [meta, device, t]
    return t
