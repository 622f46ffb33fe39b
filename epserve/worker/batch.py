"""One rank's rows of a step and their flattened inputs: token ids, positions, KV slots and
paged-attention metadata.

Invariants: decode rows come first (one token each, at its position), then prefill chunks in
the command's order; every new token has a KV slot inside its slot's block table (the rank's
validator, ``worker.ep_mirror``, refused any command without one, so nothing is re-checked
here). Block tables are not rebuilt per step: ``BlockTables`` keeps one row per slot, written
only from a command's block updates, and a step gathers its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from epserve.kernels.attention import AttentionMetadata, StateRuns
from epserve.models.traits import RowSampling
from epserve.worker.step_buffers import Cut, StepBuffers
from epserve.worker.step_buffers import align as _align
from epserve.worker.step_command import PrefillRow


@dataclass(frozen=True, slots=True)
class VerifyRun:
    """A verify row on its rank: ``tokens`` [k + 1] int64 (the fed token, then the k drafts)
    at positions ``start..start + k``, every one sampled (draws ``output_index + i``). In the
    batch each position is a one-token row of its own (``RankRows``): it attends to the
    sequence's KV up to itself, which the step writes for every position first, so a verify is
    a decode batch whose rows share a block table (the decode kernels and graphs run it). For
    a model with recurrent state (``RankRows.recurrent``) its recurrent layers run the k + 1
    positions as one sequence, in order, from the sequence's state, held and folded in after
    the verdict (``kernels.attention.StateRuns``)."""

    slot: int
    start: int
    tokens: np.ndarray
    output_index: int
    drafts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankRows:
    """This rank's rows of one command, decode rows first, and how each sampled row is drawn.

    ``decode_slots`` / ``decode_pos`` / ``decode_ids``: [D] int64, each one-token row's slot,
    position and fed token: the decode rows, then each verify row's positions (``verify``
    says which: the last ``num_verify_positions``); ``prefill``: the chunks;
    ``sampling`` / ``output_index``: one per sampled position (every one-token row, then each
    prefill row with ``sample``); ``prompt_logprobs``: per prefill row, the top-k to score its prompt
    positions with and each position's next-token target (-1: none), or None;
    ``mask_rows`` / ``mask_words``: the constrained sampled rows (indices into ``sampling``,
    [M] int64) and their token masks ([M, ceil(V / 32)] int32), None when no row has one;
    ``recurrent``: the model keeps recurrent state, so a step with verify rows carries its
    recurrent layers' runs (see ``VerifyRun``); ``penalties``: the
    penalized sampled rows' ``worker.penalties.PenaltyTable``, None when no row has one.
    """

    decode_slots: np.ndarray
    decode_pos: np.ndarray
    decode_ids: np.ndarray
    prefill: Sequence[PrefillRow]
    sampling: list[RowSampling]
    output_index: list[int]
    prompt_logprobs: Sequence[tuple[int, tuple[int, ...]] | None] = ()
    mask_rows: np.ndarray | None = None
    mask_words: np.ndarray | None = None
    verify: Sequence[VerifyRun] = ()
    recurrent: bool = False
    penalties: Any = None

    @property
    def num_decode(self) -> int:
        return len(self.decode_slots)

    @property
    def chunked(self) -> bool:
        """Sequences of more than one token in the layout (prefill chunks)."""
        return bool(self.prefill)

    @property
    def first_prefill_seq(self) -> int:
        """The index of the first prefill chunk among the layout's sequences."""
        return self.num_decode

    @property
    def num_verify_positions(self) -> int:
        return sum(len(v.tokens) for v in self.verify)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What the forward of one step reads, and the rows it came from.

    ``input_ids``: [T] int64, ``positions``: [T] int64, ``meta``: the paged layout;
    ``sample_index``: [R] int64 flat index of each sampled position: every decode row, then
    each prefill row with ``sample``, in order; ``sampled_prefill``: those prefill rows' indices.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    rows: RankRows
    sampled_prefill: tuple[int, ...]


class BlockTables:
    """Per-slot block tables on the host, one row per sequence slot, grown in place (a step
    gathers its rows instead of rebuilding them)."""

    def __init__(self, max_slots: int, max_blocks_per_seq: int):
        self.table = torch.zeros((max_slots, max_blocks_per_seq), dtype=torch.int32)
        self.np = self.table.numpy()  # the same memory, for numpy gathers
        self.max_blocks_per_seq = max_blocks_per_seq

    def set_blocks(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Write ``blocks`` into row ``slot`` from column ``first`` on."""
        if first + len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"sequence needs {first + len(blocks)} KV blocks, more than "
                             f"max_model_len allows ({self.max_blocks_per_seq})")
        if len(blocks):
            self.np[slot, first:first + len(blocks)] = blocks

    def kv_slots(self, slots: np.ndarray, pos: np.ndarray, bs: int) -> np.ndarray:
        """The KV cache slot of each (sequence slot, position) pair, int64."""
        return self.np[slots, pos // bs].astype(np.int64) * bs + pos % bs


def build_step_inputs(rows: RankRows, tables: BlockTables, block_size: int,
                      device: torch.device, states: bool = False,
                      buffers: StepBuffers | None = None) -> StepInputs:
    """Flatten the one-token rows (decode rows, then verify positions) and the prefill
    chunks into one token batch, written into the next of ``buffers`` (fresh memory
    without). The layout, in int64 words: ids | positions | KV slots (``align(n, 2)`` each) |
    sample index (``align(nr, 2)``) | with ``states`` each sequence's state slot (its model
    keeps recurrent state per slot: ``AttentionMetadata.state_slots``, ``align(ns, 2)``), then
    int32 seq lens (``align(ns, 4)``) | block tables ``[ns, width]``: one buffer, one copy."""
    bufs = buffers if buffers is not None else StepBuffers(device, reuse=False)
    if not rows.chunked:
        return _decode_inputs(rows, tables, block_size, bufs, states)
    bs = block_size
    nd = rows.num_decode
    dpos = rows.decode_pos
    ids, pos, kv = [rows.decode_ids], [dpos], [tables.kv_slots(rows.decode_slots, dpos, bs)]
    sample_index = list(range(nd))
    sampled_prefill = []
    seq_lens, qsl, slots = [dpos + 1], list(range(nd + 1)), [rows.decode_slots]
    for r, row in enumerate(rows.prefill):
        n, start = len(row.tokens), row.start
        p = np.arange(start, start + n, dtype=np.int64)
        ids.append(np.asarray(row.tokens, dtype=np.int64))
        pos.append(p)
        kv.append(tables.kv_slots(np.full(n, row.slot), p, bs))
        qsl.append(qsl[-1] + n)
        seq_lens.append(np.array([start + n], dtype=np.int64))
        slots.append(np.array([row.slot], dtype=np.int64))
        if row.sample:
            sample_index.append(qsl[-1] - 1)
            sampled_prefill.append(r)
    lens = np.concatenate(seq_lens) if len(seq_lens) > 1 else seq_lens[0]
    n, ns, nr = qsl[-1], len(lens), len(sample_index)
    width = -(-int(lens.max()) // bs)
    n2, ns4 = _align(n, 2), _align(ns, 4)
    cut = bufs.take(n, nr, ns, width, states)
    v64, v32 = cut.v64, cut.v32
    for k, parts in enumerate((ids, pos, kv)):
        v64[k * n2:k * n2 + n] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    v64[3 * n2:3 * n2 + nr] = sample_index
    v32[:ns] = lens
    row_slots = np.concatenate(slots) if len(slots) > 1 else slots[0]
    if states:
        v64[3 * n2 + _align(nr, 2):][:ns] = row_slots
    v32[ns4:ns4 + ns * width].reshape(ns, width)[:] = tables.np[row_slots, :width]
    return _finish(rows, cut, tuple(qsl), lens, tuple(sampled_prefill), bs)


def _decode_inputs(rows: RankRows, tables: BlockTables, bs: int, bufs: StepBuffers,
                   states: bool) -> StepInputs:
    """A pure decode step's inputs: the same layout, written in place with as few array calls
    as possible (at a few hundred rows a step's host time is per-call overhead)."""
    nd = rows.num_decode
    slots, pos = rows.decode_slots, rows.decode_pos
    n2, ns4 = _align(nd, 2), _align(nd, 4)
    lens = pos + 1
    width = -(-int(lens.max()) // bs)
    cut = bufs.take(nd, nd, nd, width, states)
    v64, v32 = cut.v64, cut.v32
    v64[:nd] = rows.decode_ids
    v64[n2:n2 + nd] = pos
    blk, off = np.divmod(pos, bs)
    kv = v64[2 * n2:2 * n2 + nd]
    np.multiply(tables.np[slots, blk], bs, out=kv)
    kv += off
    v64[3 * n2:3 * n2 + nd] = _ARANGE[:nd] if nd <= len(_ARANGE) else np.arange(nd)
    if states:
        v64[4 * n2:4 * n2 + nd] = slots
    v32[:nd] = lens
    v32[ns4:ns4 + nd * width].reshape(nd, width)[:] = tables.np[slots, :width]
    return _finish(rows, cut, _ranges(nd), lens, (), bs)


_ARANGE = np.arange(4096, dtype=np.int64)
_RANGES: dict[int, tuple[int, ...]] = {}


def _ranges(n: int) -> tuple[int, ...]:
    """``tuple(range(n + 1))``, built once per row count (a decode step's query starts)."""
    r = _RANGES.get(n)
    if r is None:
        r = _RANGES[n] = tuple(range(n + 1))
    return r


def state_runs(rows: RankRows) -> StateRuns:
    """A recurrent model's runs of a step with verify rows: each plain decode row alone, each
    verify row's positions one held run, each prefill chunk (the layout's row order)."""
    plain = rows.num_decode - rows.num_verify_positions
    lens = [1] * plain + [len(v.tokens) for v in rows.verify] + [len(p.tokens)
                                                                  for p in rows.prefill]
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    slots = np.concatenate([rows.decode_slots[:plain], [v.slot for v in rows.verify],
                            [p.slot for p in rows.prefill]]).astype(np.int64)
    fresh = np.concatenate([rows.decode_pos[:plain] == 0, [v.start == 0 for v in rows.verify],
                            [p.start == 0 for p in rows.prefill]]).astype(bool)
    return StateRuns(tuple(cu.tolist()), slots, fresh,
                     tuple(range(plain, plain + len(rows.verify))))


def _finish(rows: RankRows, cut: Cut, qsl: tuple[int, ...], lens: np.ndarray,
            sampled_prefill: tuple[int, ...], bs: int) -> StepInputs:
    """Copy the written buffer to the device (nothing to copy on the CPU) and hand out the
    step's tensors (its layout's views)."""
    cut.ship()
    meta = AttentionMetadata(
        slot_mapping=cut.kv,
        query_start_loc=qsl,
        seq_lens=tuple(lens.tolist()),
        block_tables=cut.tables,
        block_size=bs,
        seq_lens_t=cut.lens if not rows.chunked else None,
        state_slots=cut.state_slots,
        state_runs=state_runs(rows) if rows.recurrent and rows.verify else None,
    )
    return StepInputs(input_ids=cut.ids, positions=cut.pos, meta=meta, sample_index=cut.sample,
                      rows=rows, sampled_prefill=sampled_prefill)
