"""One step's flattened inputs: token ids, positions, KV slots and paged-attention metadata.

Invariants: decode rows come first (one token each, at position ``seq_len``), then prefill
chunks in the caller's order; every new token has a KV slot inside its sequence's block table
(the scheduler reserved it) — a row without one is refused here, before any device work.
Block tables are not rebuilt per step: ``BlockTables`` keeps one row per slot, grown in place.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Sequence

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.traits import SequenceState


@dataclass(frozen=True, slots=True)
class StepRow:
    """One prefill chunk: ``tokens`` fed at positions ``start..``.

    ``sample``: the chunk is the prompt's last, so its last position is sampled.
    ``prompt_targets``: for prompt logprobs, the next-token target of each position (``-1``
    where a position has none); empty when not collecting.
    """

    seq: SequenceState
    tokens: Sequence[int]
    start: int
    sample: bool
    prompt_targets: Sequence[int] = ()


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
    decode_tokens: Sequence[int]
    decode_seqs: Sequence[SequenceState]
    prefill_rows: Sequence[StepRow]
    sampled_prefill: tuple[int, ...]


def _i64(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """[N] int64 from host ints; array.array is ~4x faster than torch.tensor on a list."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device)


class BlockTables:
    """Per-slot host state the runner keeps across steps: each slot's block table row, its
    block count and its KV length (``seq_len``), so a decode step gathers rather than loops."""

    def __init__(self, max_slots: int, max_blocks_per_seq: int):
        self.table = torch.zeros((max_slots, max_blocks_per_seq), dtype=torch.int32)
        self.num_blocks = torch.zeros(max_slots, dtype=torch.int64)
        self.seq_lens = torch.zeros(max_slots, dtype=torch.int64)
        self.max_blocks_per_seq = max_blocks_per_seq

    def set_blocks(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Write ``blocks`` into row ``slot`` from column ``first`` on."""
        if first + len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"sequence needs {first + len(blocks)} KV blocks, more than "
                             f"max_model_len allows ({self.max_blocks_per_seq})")
        if blocks:
            self.table[slot, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.num_blocks[slot] = first + len(blocks)

    def reset(self, slot: int) -> None:
        self.num_blocks[slot] = 0
        self.seq_lens[slot] = 0

    def rows(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """[S, width] int32: the tables of ``slots`` ([S] int64, a copy)."""
        return self.table[:, :width].index_select(0, slots)


def _decode_part(slots: torch.Tensor, tables: BlockTables, bs: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[D] positions and [D] KV slots of the decode rows (one token each, at ``seq_len``)."""
    pos = tables.seq_lens.index_select(0, slots)
    blk = pos // bs
    ok = blk < tables.num_blocks.index_select(0, slots)
    if not bool(ok.all()):
        bad = int((~ok).nonzero()[0, 0])
        raise ValueError(f"decode row {bad}: no KV block reserved for position {int(pos[bad])}")
    phys = tables.table[slots, blk].to(torch.int64)
    return pos, phys * bs + pos % bs


def build_step_inputs(decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_rows: Sequence[StepRow], tables: BlockTables, block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten decode rows then prefill chunks into one token batch."""
    nd = len(decode_seqs)
    bs = block_size
    cpu = torch.device("cpu")
    slot_ids = [s.slot_idx for s in decode_seqs] + [row.seq.slot_idx for row in prefill_rows]
    slot_t = _i64(slot_ids, cpu)
    pos_t, kv_t = _decode_part(slot_t[:nd], tables, bs)
    ids = list(decode_tokens)
    pos: list[int] = []
    slots: list[int] = []
    seq_lens = (pos_t + 1).tolist()
    qsl = list(range(nd + 1))
    sample_index = list(range(nd))
    sampled_prefill = []
    for r, row in enumerate(prefill_rows):
        n, start = len(row.tokens), row.start
        end = start + n
        table = row.seq.block_table
        if n == 0 or end > len(table) * bs:
            raise ValueError(f"prefill row {r}: {n} tokens at {start} need KV blocks through "
                             f"position {end - 1}, the block table covers {len(table) * bs}")
        ids.extend(row.tokens)
        pos.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        qsl.append(qsl[-1] + n)
        seq_lens.append(end)
        if row.sample:
            sample_index.append(qsl[-1] - 1)
            sampled_prefill.append(r)
    if pos:
        pos_t = torch.cat([pos_t, _i64(pos, cpu)])
        kv_t = torch.cat([kv_t, _i64(slots, cpu)])
    width = -(-max(seq_lens) // bs)
    meta = AttentionMetadata(
        slot_mapping=kv_t.to(device),
        query_start_loc=tuple(qsl),
        seq_lens=tuple(seq_lens),
        block_tables=tables.rows(slot_t, width).to(device),
        block_size=bs,
    )
    return StepInputs(
        input_ids=_i64(ids, device),
        positions=pos_t.to(device),
        meta=meta,
        sample_index=_i64(sample_index, device),
        decode_tokens=decode_tokens, decode_seqs=decode_seqs, prefill_rows=prefill_rows,
        sampled_prefill=tuple(sampled_prefill),
    )
