"""One step's flattened inputs: token ids, positions, KV slots and paged-attention metadata.

Invariants: rows keep the caller's order (decode rows first, then prefill chunks); a row's new
tokens sit at positions ``start .. start+len-1`` of its sequence and every one of them has a
KV slot inside the sequence's block table (the scheduler reserved it). Block tables are not
rebuilt per step: ``BlockTables`` keeps one row per slot and is updated as blocks are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.traits import SequenceState


@dataclass(frozen=True, slots=True)
class StepRow:
    """One sequence's part of a step: ``tokens`` fed at positions ``start..``.

    ``sample``: the row's last position is sampled (a decode row, or a prefill's last chunk).
    ``prompt_targets``: for prompt logprobs, the next-token targets of the row's positions
    (``-1`` where a position has none); empty when not collecting.
    """

    seq: SequenceState
    tokens: Sequence[int]
    start: int
    sample: bool
    prompt_targets: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What the forward of one step reads.

    ``input_ids``: [T] int64, ``positions``: [T] int64, ``meta``: the paged layout.
    ``sample_index``: flat index of each sampled row's last position, in row order.
    ``sampled_rows``: indices into the row list of the rows that sample.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    sampled_rows: tuple[int, ...]


class BlockTables:
    """Per-slot block tables on the host, one row per sequence slot, grown in place."""

    def __init__(self, max_slots: int, max_blocks_per_seq: int):
        self.table = torch.zeros((max_slots, max_blocks_per_seq), dtype=torch.int32)
        self.max_blocks_per_seq = max_blocks_per_seq

    def set_blocks(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Write ``blocks`` into row ``slot`` from column ``first`` on."""
        if first + len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"sequence needs {first + len(blocks)} KV blocks, more than "
                             f"max_model_len allows ({self.max_blocks_per_seq})")
        if blocks:
            self.table[slot, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def rows(self, slots: Sequence[int], width: int) -> torch.Tensor:
        """[S, width] int32: the tables of ``slots`` (a copy)."""
        return self.table[torch.tensor(slots, dtype=torch.long), :width]


def build_step_inputs(rows: Sequence[StepRow], tables: BlockTables, block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten ``rows`` into one token batch; every row's KV slots must already be reserved."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    sample_index: list[int] = []
    sampled_rows: list[int] = []
    for r, row in enumerate(rows):
        n = len(row.tokens)
        end = row.start + n
        table = row.seq.block_table
        if n == 0 or end > len(table) * block_size:
            raise ValueError(f"row {r}: {n} tokens at {row.start} need KV blocks through "
                             f"position {end - 1}, the block table covers {len(table) * block_size}")
        ids.extend(row.tokens)
        pos.extend(range(row.start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(row.start, end))
        qsl.append(qsl[-1] + n)
        seq_lens.append(end)
        if row.sample:
            sample_index.append(qsl[-1] - 1)
            sampled_rows.append(r)
    width = max(-(-s // block_size) for s in seq_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        query_start_loc=tuple(qsl),
        seq_lens=tuple(seq_lens),
        block_tables=tables.rows([row.seq.slot_idx for row in rows], width).to(device),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device),
        positions=torch.tensor(pos, dtype=torch.int64).to(device),
        meta=meta,
        sample_index=torch.tensor(sample_index, dtype=torch.int64).to(device),
        sampled_rows=tuple(sampled_rows),
    )
